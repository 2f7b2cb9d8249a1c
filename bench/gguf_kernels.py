"""forklm's block kernel against ggml's own dot products, per GGUF type, on the same stored bytes.

For each type both run, a weight of the default model's ffn_down shape ([576, 1536]) and its
gate/up shape ([3072, 576], types with 32-value blocks) is quantized by ggml itself, repacked once for
the block kernel (`quant.stored_block_weights`, as a file's tensors are at load) and multiplied by
T rows of float32 activations through both kernels; the median of interleaved repeats is reported
per (type, shape, T), with the ratio. The CPU is recorded beside the numbers.

    .venv/bin/python bench/gguf_kernels.py --out bench/results/gguf_kernels_cpu_avx2_2026-11-26.json

Run nothing else on the machine meanwhile (flock /tmp/forklm_bench.lock).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from forklm.device import cpu_flags, cpu_model
from forklm.kernels import block_gemm, ggml_gemm
from forklm.models import quant

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
SHAPES = [(576, 1536), (3072, 576)]  # (N, K): SmolLM2's ffn_down and its fused gate/up


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32", help="activation rows T")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--types", default=",".join(TYPES), help="GGUF types, comma-separated")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="weight shapes NxK, comma-separated (e.g. 16384x2048,2048x8192: Llama-3.2-1B's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if block_gemm.build_error() or ggml_gemm.build_error():
        raise SystemExit(f"kernels missing: block {block_gemm.build_error()}, ggml {ggml_gemm.build_error()}")
    torch.manual_seed(0)
    rows = []
    for type_name in args.types.split(","):
        for n, k in shapes:
            if (type_name.endswith("_K") or type_name == "IQ4_XS") and k % 256:
                continue
            stored = ggml_gemm.quantize(torch.randn(n, k) * 0.05, type_name)
            blocks = quant.stored_block_weights([stored])
            for t in (int(r) for r in args.rows.split(",")):
                x = torch.randn(t, k)
                for _ in range(3):  # warm both
                    block_gemm.gemm(x, blocks), ggml_gemm.gemm(x, stored)
                b_ms, g_ms = [], []
                for _ in range(args.repeats):  # interleaved, so drift hits both
                    b_ms.append(_ms(lambda: block_gemm.gemm(x, blocks)))
                    g_ms.append(_ms(lambda: ggml_gemm.gemm(x, stored)))
                row = {"type": type_name, "n": n, "k": k, "rows": t, "layout": blocks.kind,
                       "block_kernel_ms": statistics.median(b_ms), "ggml_ms": statistics.median(g_ms)}
                row["block_over_ggml_speed"] = row["ggml_ms"] / row["block_kernel_ms"]
                rows.append(row)
                print(f"{type_name:5s} [{n}x{k}] T={t:3d}: block {row['block_kernel_ms']:.3f} ms, "
                      f"ggml {row['ggml_ms']:.3f} ms, block kernel {row['block_over_ggml_speed']:.2f}x")
    doc = {"meta": {"cpu": cpu_model(), "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "f16c", "fma"))),
                    "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats,
                    "vnni_build": block_gemm.uses_vnni()},
           "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
