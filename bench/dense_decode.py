"""A dense Hugging Face checkpoint's decode steps per dtype and decode-attention kernel (quantize=None).

    flock /tmp/forklm_bench.lock .venv/bin/python -m bench.dense_decode --model FOLDER [--ns 1,8,32]
        [--rounds 3] [--out bench/results/dense_decode.json]

What a user with a float checkpoint gets from `LLM(folder, quantize=None)`: bfloat16 (what
`dtype="auto"` picks on a CPU with native bfloat16) on the C++ decode attention (over its bfloat16
cache) and on PyTorch's attention, and float32 on the C++ attention. A 256-token prompt of fixed ids,
`generate` of one request of n samples, 32 new tokens each after a warm-up call, configurations
interleaved over `rounds`; the median decode step of each (the step's wall time, `stats.step_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

CONFIGS = (("bfloat16", "cpu"), ("bfloat16", "torch"), ("float32", "cpu"))


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine_info
    from forklm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder")
    ap.add_argument("--ns", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/dense_decode.json")
    args = ap.parse_args(argv)
    prompt = list(range(1000, 1256))
    llms = {dtype: LLM(args.model, dtype=dtype, device="cpu", quantize=None) for dtype in ("bfloat16", "float32")}
    ns = [int(x) for x in args.ns.split(",")]
    steps: dict[tuple, list[float]] = {(d, k, n): [] for d, k in CONFIGS for n in ns}
    for _ in range(args.rounds):
        for n in ns:
            for dtype, kernel in CONFIGS:
                req = {"prompt": prompt, "n": n, "max_tokens": 32, "seed": 0, "ignore_eos": True}
                out = llms[dtype].generate([req], decode_kernel=kernel)[0]
                steps[(dtype, kernel, n)].append(statistics.median(out.stats.step_s))
    rows = []
    for n in ns:
        row = {"n": n}
        for dtype, kernel in CONFIGS:
            row[f"{dtype}_{kernel}_step_ms"] = statistics.median(steps[(dtype, kernel, n)]) * 1e3
        rows.append(row)
        print(f"n={n}: " + ", ".join(f"{d} + {k} attention {row[f'{d}_{k}_step_ms']:.2f} ms" for d, k in CONFIGS),
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "model": args.model,
                               "prompt_tokens": len(prompt), "new_tokens": 32, "rounds": args.rounds,
                               "weights_mib": {d: llm.model.num_weight_bytes() / 2**20 for d, llm in llms.items()},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
