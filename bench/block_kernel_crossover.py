"""Where the block kernel stops paying off against a `BlockLinear`'s dense copy, by rows per step.

    python -m bench.block_kernel_crossover [--rows 8,16,24,32,48,64] [--rounds 9]
        [--out bench/results/block_kernel_crossover_cpu.json]

Loads the default model (its GGUF Q4_1 / Q8_0 blocks on the block kernel, dense copies in
`forklm.backend.block_dense_dtype()`: bfloat16 on CPUs that multiply it natively, else float32) and, per row
count, runs a step's 120 layer products (30 layers x q/k/v, o, gate/up, down) and the LM head on
the kernel and on the dense copies (activations rounded to the copy's dtype and back, as
`BlockLinear.forward` does), each on its own random activations, rounds interleaved. Reports the
minimum and median over rounds. The rows at or below which `BlockLinear` runs the kernel
(`forklm.backend.BLOCK_KERNEL_MAX_ROWS*`) are set from these numbers. Run it alone (`flock
/tmp/forklm_bench.lock ...`): this VM's run-to-run spread is 10-20%. With FORKLM_CPU_ISA=avx2 (and
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2) it measures the
choices of an AVX2-only CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info


def _kernel(w, x: torch.Tensor) -> torch.Tensor:
    from forklm.kernels import block_gemm as bg

    return bg.gemm(x, w.blocks)


def _dense(w, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(w.dense.dtype), w.dense).float()


def run(rows_list: list[int], rounds: int) -> dict:
    from forklm import LLM
    from forklm.backend import block_dense_dtype

    model = LLM().model
    layers = [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")]
    groups = {"layers": layers, "lm_head": [model.lm_head]}
    out = {"dense_dtype": str(block_dense_dtype()).removeprefix("torch."), "rows": {}}
    for rows in rows_list:
        res = {}
        for group, mats in groups.items():
            xs = [torch.randn(rows, w.in_features) for w in mats]
            times = {"kernel": [], "dense": []}
            for _ in range(rounds):
                for name, fn in (("kernel", _kernel), ("dense", _dense)):
                    t = time.perf_counter()
                    for w, x in zip(mats, xs):
                        fn(w, x)
                    times[name].append((time.perf_counter() - t) * 1e3)
            res[group] = {f"{name}_ms_{stat}": f(v) for name, v in times.items()
                          for stat, f in (("min", min), ("median", statistics.median))}
        out["rows"][rows] = res
        print(f"{rows:3d} rows: layers kernel {res['layers']['kernel_ms_min']:.1f} ms, dense "
              f"{res['layers']['dense_ms_min']:.1f}; LM head kernel {res['lm_head']['kernel_ms_min']:.1f}, dense "
              f"{res['lm_head']['dense_ms_min']:.1f} (minima over {rounds} rounds)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,24,32,48,64", help="rows per step, comma-separated")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="bench/results/block_kernel_crossover_cpu.json")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    res = run(rows, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "rounds": args.rounds, **res}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
