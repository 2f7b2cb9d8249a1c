"""Distinct prompts, nothing shared (the chat server's case): the engine's decode step against
transformers' `generate` over the same prompts as one dense batch, and against forklm's own
model over a dense contiguous KV cache (the layout a single-batch engine would use), side by side.

    python -m bench.distinct_prompts --dtype float32 --out bench/results/distinct_cpu_float32.json

Each point: `rows` requests of `prompt_len` distinct tokens (real code text at different offsets),
n = 1, `new_tokens` each, temperature 0.8, top-p 0.95, EOS ignored. Reported: the median decode
step (one forward over every row + the draw) of each implementation, and the ratios.
- engine: `LLM.generate` (prefix cache off, so every prompt is prefilled; a token budget that
  prefills every prompt in the first step, so each later step decodes all rows together).
- dense: the same model, rows prefilled one by one into a `[rows, g, L, D]` cache per layer, then
  each step one forward whose attention is one SDPA call over the dense cache (no paging, no
  planning, no scheduler), plus the same batched draw.
Each implementation runs `--repeats` times, interleaved; a point reports the median of the runs'
median steps (the machine's speed drifts by ±15% between runs).
- transformers: `generate` on the `[rows, prompt_len]` batch (equal lengths: no padding).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from forklm.attention.segments import attend_segment
from bench.machine import machine_info
from bench.sweep import write_json
from bench.prompts import SNIPPET, TEMPERATURE, TOP_P
from bench.sweep import TransformersRunner, _step_clock
from forklm.reference.forked_attention import PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache
from forklm.sampling.sampler import sample_tokens


def distinct_prompts(llm, rows: int, prompt_len: int) -> list[list[int]]:
    """`rows` prompts of exactly `prompt_len` tokens: the snippet's tokens rotated by a different
    offset per row and a row-specific head, so no two share a block."""
    ids = llm.tokenizer.encode(SNIPPET * (prompt_len // 50 + 2), add_special_tokens=False)
    out = []
    for r in range(rows):
        rot = ids[(r * 37) % len(ids) :] + ids[: (r * 37) % len(ids)]
        out.append(([(r * 7919) % 1000 + 100] + rot)[:prompt_len])
    return out


class DenseDecode:
    """Decode attention over a dense `[rows, g, L, D]` cache (all rows the same length)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        self.k, self.v, self.length = k, v, length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, h, D = q.shape
        g = k.shape[1]
        t = self.length
        self.k[layer][:, :, t] = k
        self.v[layer][:, :, t] = v
        o, _ = attend_segment(q.view(B, g, h // g, D), self.k[layer][:, :, : t + 1], self.v[layer][:, :, : t + 1],
                              1.0 / math.sqrt(D))
        return o.reshape(B, h, D)


def dense_steps(llm, prompts: list[list[int]], new_tokens: int) -> list[float]:
    model, c = llm.model, llm.config
    B, m = len(prompts), len(prompts[0])
    K = [torch.empty(B, c.num_kv_heads, m + new_tokens, c.head_dim, dtype=model.dtype) for _ in range(c.num_layers)]
    V = [torch.empty_like(t) for t in K]
    last = []
    for r, p in enumerate(prompts):  # prefill row by row (not timed)
        cache = ForkedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m, 1, 1, model.dtype, model.device)
        lg = model.forward(torch.tensor(p), torch.arange(m), PrefillAttention(cache), logits_rows=torch.tensor([m - 1]))
        for layer in range(c.num_layers):
            K[layer][r, :, :m] = cache.ctx_k[layer][0]
            V[layer][r, :, :m] = cache.ctx_v[layer][0]
        last.append(lg[0])
    logits = torch.stack(last)
    g = torch.Generator().manual_seed(0)
    steps = []
    for t in range(new_tokens - 1):
        t0 = time.perf_counter()
        tokens = sample_tokens(logits, TEMPERATURE, 0, TOP_P, torch.rand(B, generator=g, dtype=torch.float64))
        logits = model.forward(tokens, torch.full((B,), m + t, dtype=torch.long), DenseDecode(K, V, m + t))
        steps.append(time.perf_counter() - t0)
    return steps


def engine_steps(llm, prompts: list[list[int]], new_tokens: int) -> list[float]:
    specs = [dict(prompt=p, n=1, max_tokens=new_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=i, ignore_eos=True)
             for i, p in enumerate(prompts)]
    # Every prompt prefilled in the first step, so every later step decodes all rows together.
    outs = llm.generate(specs, prefix_cache=False, max_num_seqs=max(len(prompts), 1),
                        max_batch_tokens=sum(len(p) for p in prompts) + len(prompts))
    return outs[0].stats.step_s


def transformers_steps(hf: TransformersRunner, prompts: list[list[int]], new_tokens: int) -> list[float]:
    clock = _step_clock(hf.device)
    hf._generate(torch.tensor(prompts), 1, new_tokens, clock)
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def main(argv: list[str] | None = None) -> int:
    from forklm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--points", default="16x512,64x512,16x2048", help="rows x prompt_len, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per implementation, interleaved (median reported)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    llm = LLM(dtype=args.dtype, device="cpu")
    hf = None if args.no_transformers else TransformersRunner.load(llm.source, llm.dtype, llm.device)
    # warm-up: first calls allocate and pick kernels
    warm = distinct_prompts(llm, 2, 32)
    engine_steps(llm, warm, 3), dense_steps(llm, warm, 3)
    if hf:
        transformers_steps(hf, warm, 3)
    results = []
    for point in args.points.split(","):
        rows, m = (int(x) for x in point.split("x"))
        prompts = distinct_prompts(llm, rows, m)
        row = {"rows": rows, "prompt_len": m, "new_tokens": args.new_tokens}
        runs = [("engine", lambda: engine_steps(llm, prompts, args.new_tokens)),
                ("dense", lambda: dense_steps(llm, prompts, args.new_tokens))]
        if hf:
            runs.append(("transformers", lambda: transformers_steps(hf, prompts, args.new_tokens)))
        repeats: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits all alike
            for name, fn in runs:
                repeats[name].append(statistics.median(fn()) * 1e3)
        for name, ms in repeats.items():
            row[f"{name}_step_ms"] = statistics.median(ms)
            row[f"{name}_step_ms_repeats"] = ms
        if "transformers_step_ms" in row:
            row["transformers_over_engine"] = row["transformers_step_ms"] / row["engine_step_ms"]
        row["engine_over_dense"] = row["engine_step_ms"] / row["dense_step_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)
    doc = {**machine_info(), "dtype": str(llm.dtype),
           "command": "python -m bench.distinct_prompts " + " ".join(argv or __import__("sys").argv[1:]),
           "results": results}
    if args.out:
        write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
