"""`python -m bench.mla_attention`: one layer's decode attention of DeepSeek-V2-Lite's shape (16
heads; kv_lora_rank 512, rope 64, nope 128, v 128) on the engine's own paged pool and planner, n
samples of one m_c-token prompt, each with `own` tokens of its own:

- latent, absorbed (forklm's MLA path: `PagedAttention.attend_latent`, one cached latent of 576 per
  token, multi-query attention with 16 query heads per sample), the shared prompt's latents read
  once for all n·16 query rows (bifurcated) or once per sample (standard);
- expanded (what an engine without the absorbed form caches: per-head K of 192 = nope + rope and V
  of 128, stored here as 16 KV heads of 192 with V padded, as a pool of one head width holds them),
  bifurcated and standard;

on the C++ attention kernel ("cpu") and PyTorch's products ("torch"). Reported: bytes per cached
token (per layer) both ways, the median step time of each path, and the largest n a fixed KV memory
budget holds both ways (prompt once plus n tails when the prompt is shared, as forklm's pool holds
it). The CPU is recorded beside the numbers. Run nothing else meanwhile (flock /tmp/forklm_bench.lock).

    .venv/bin/python -m bench.mla_attention --out bench/results/mla_attention_cpu_avx2_2026-11-26.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from forklm.attention.paged import DecodeRow, PagedAttention, StepPlanner
from forklm.cache.paged_kv import PagedKVCache
from forklm.device import cpu_flags, cpu_model

HEADS, RANK, ROPE, NOPE, VDIM = 16, 512, 64, 128, 128  # DeepSeek-V2-Lite's attention
LATENT = RANK + ROPE
BLOCK = 16


@dataclass
class PoolShape:
    """What PagedKVCache reads of a model config."""

    num_kv_heads: int
    head_dim: int
    kv_shares_values: bool
    num_layers: int = 1


def step_ms(kind: str, path: str, kernel: str, n: int, m_c: int, own: int, reps: int) -> float:
    """Median time of one layer's decode attention over n rows (ms)."""
    latent = kind == "latent"
    shape = PoolShape(1, LATENT, True) if latent else PoolShape(HEADS, NOPE + ROPE, False)
    prompt_blocks, own_blocks = m_c // BLOCK, -(-(own + 1) // BLOCK)
    pool = PagedKVCache(shape, prompt_blocks + n * own_blocks, BLOCK, torch.float32, torch.device("cpu"))
    for t in pool.k + ([] if latent else pool.v):
        t.normal_()
    rows = [DecodeRow(list(range(prompt_blocks)) + [prompt_blocks + i * own_blocks + j for j in range(own_blocks)],
                      m_c + own, prompt_blocks, key=i) for i in range(n)]
    q = torch.randn(n, HEADS, shape.head_dim)
    new = torch.randn(n, shape.num_kv_heads, shape.head_dim)
    scale = 1.0 / (NOPE + ROPE) ** 0.5
    times = []
    for _ in range(reps + 2):
        planner = StepPlanner(BLOCK, path, torch.device("cpu"), kernel, HEADS, shape.num_kv_heads, pool.num_slots)
        plan = planner.plan(rows, [])  # planned outside the timing
        attn = PagedAttention(pool, plan)
        t0 = time.perf_counter()
        if latent:
            attn.attend_latent(0, q, new[:, 0], RANK, scale)
        else:
            attn.attend(0, q, new, new, scale)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def largest_n(budget_bytes: int, per_token: int, m_c: int, own: int, shared: bool) -> int:
    """Samples a KV budget holds: the prompt once and n tails (shared), or n whole sequences."""
    if shared:
        return max(0, (budget_bytes - m_c * per_token) // (own * per_token))
    return budget_bytes // ((m_c + own) * per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m-c", type=int, default=4096)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--own", type=int, default=32, help="tokens of each sample's own before this step")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-gib", type=float, default=4.0, help="KV budget for the largest-n column (27 layers)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    e = 4  # float32 here; a bfloat16 / float16 cache halves both ways alike
    per_token = {"latent": LATENT * e, "expanded": HEADS * (NOPE + ROPE + VDIM) * e}  # per layer, as stored by their engines
    rows = []
    for kernel in ("cpu", "torch"):
        for kind in ("latent", "expanded"):
            for path in ("bifurcated", "standard"):
                ms = step_ms(kind, path, kernel, args.n, args.m_c, args.own, args.reps)
                rows.append({"kernel": kernel, "cache": kind, "path": path, "step_ms": ms})
                print(f"{kernel:5s} {kind:8s} {path:10s}: {ms:8.2f} ms")
    budget = int(args.budget_gib * 2**30) // 27  # per layer: DeepSeek-V2-Lite has 27
    fits = {kind: {"prompt shared": largest_n(budget, per_token[kind], args.m_c, args.own, True),
                   "prompt per sample": largest_n(budget, per_token[kind], args.m_c, args.own, False)}
            for kind in per_token}
    doc = {"meta": {"cpu": cpu_model(), "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))),
                    "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": "float32",
                    "shape": {"heads": HEADS, "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE,
                              "v_head_dim": VDIM},
                    "m_c": args.m_c, "n": args.n, "own": args.own, "reps": args.reps,
                    "command": "python -m bench.mla_attention " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)},
           "bytes_per_token_per_layer": per_token, "budget_gib_27_layers": args.budget_gib, "largest_n": fits,
           "rows": rows}
    print(json.dumps({"bytes_per_token_per_layer": per_token, "largest_n": fits}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
