"""bfloat16 / float16 weights as stored: the block kernel's `gemm_bf16` / `gemm_f16` (float32
activations, float32 math) against PyTorch's products on the same weights, one product per shape and
row count, median ms.

    python -m bench.half_kernels [--rows 1,8,32,128,512] [--shapes 8192x2048,1536x576] [--dtype bfloat16]
        [--out bench/results/half_kernels_<cpu>.json]

Per point: forklm (`gemm_bf16` / `gemm_f16`), PyTorch's F.linear on the 16-bit weights and activations
rounded to them (what a dense bfloat16 model runs), and PyTorch's float32 F.linear on the widened weights
(what a float32 model runs). Shapes are [out x in]: 8192 x 2048 is an 8B MLP up-projection's width at
2048, 1536 x 576 SmolLM2-135M's gate/up half. Run it alone (`flock /tmp/forklm_bench.lock ...`); an A/B
of two commits runs it under each (`PYTHONPATH=<worktree> python -m bench.half_kernels` from outside the
repository).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import machine_info
from bench.quant_kernels import time_ms
from forklm.kernels import block_gemm


def measure(shapes: list[tuple[int, int]], rows: list[int], dtype: torch.dtype) -> list[dict]:
    ext = block_gemm._extension()
    product = ext.gemm_bf16 if dtype == torch.bfloat16 else ext.gemm_f16
    amx = dtype == torch.bfloat16 and bool(ext.amx_bf16_enabled())  # AMX-BF16 tiles where K % 32 == 0
    out = []
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen).to(dtype)
        wf = w.float()
        for t in rows:
            x = torch.randn(t, k, generator=gen)
            xh = x.to(dtype)
            y = product(x, w, block_gemm.PLAIN, None, 0.0, None)
            ref = F.linear(x.double(), wf.double())
            row = {"n": n, "k": k, "rows": t,
                   "forklm_ms": time_ms(lambda: product(x, w, block_gemm.PLAIN, None, 0.0, None)),
                   "forklm_tiles": "AMX-BF16" if amx else "vector"}
            if amx:  # the vector chains too, AMX off in this process for the one timing
                ext.set_amx(False)
                row["forklm_vector_ms"] = time_ms(lambda: product(x, w, block_gemm.PLAIN, None, 0.0, None))
                ext.set_amx(True)
            row |= {"torch_16bit_ms": time_ms(lambda: F.linear(xh, w)),
                    "torch_float32_ms": time_ms(lambda: F.linear(x, wf)),
                    "forklm_rel_err": ((y.double() - ref).norm() / ref.norm()).item()}
            vec = f" (vector chains {row['forklm_vector_ms']:.3f})" if amx else ""
            print(f"{n} x {k}, {t} rows: forklm {row['forklm_ms']:.3f} ms{vec}, PyTorch {dtype} {row['torch_16bit_ms']:.3f}, "
                  f"float32 {row['torch_float32_ms']:.3f}", flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,128,512")
    ap.add_argument("--shapes", default="8192x2048,1536x576")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if block_gemm.build_error() is not None:
        raise SystemExit(f"the block kernel is not available: {block_gemm.build_error()}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    points = measure(shapes, rows, getattr(torch, args.dtype))
    result = {"meta": {"machine": machine_info(), "build": block_gemm.LOADED_BUILDS.get("forklm_block_gemm"),
                       "dtype": args.dtype, "threads": torch.get_num_threads()}, "points": points}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
