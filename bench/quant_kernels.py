"""Weight-product kernels per shape: dense float32 / bfloat16 against PyTorch's int8 and int4 CPU
kernels and forklm's AVX2 block kernel on GGUF Q4_1 / Q8_0 blocks (where it builds), at the rows T a step has (decode: T = samples; prefill chunks: hundreds). This picks
`forklm.backend.KERNEL_MAX_ROWS` (README "Quantized weights").

    python -m bench.quant_kernels [--rows 1,2,4,8,16,32,64,256] [--out bench/results/quant_kernels_cpu.json]

Shapes are SmolLM2-135M's products ([in -> out]): fused q/k/v 576 -> 960, o 576 -> 576, fused
gate/up 576 -> 3072, down 1536 -> 576, LM head 576 -> 49152. Each point is the median of
repeated calls on one thread pool (run it alone: `flock /tmp/forklm_bench.lock ...`). The products
are checked against each other (relative error vs the dense product of the same dequantized weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.machine import machine_info
from forklm.kernels import block_gemm
from forklm.models.quant import BlockQuantized, int4_from_float, int8_from_float

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def time_ms(fn, min_time: float = 0.25, max_reps: int = 200) -> float:
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(rows: list[int], float32_kernel_rows: list[int]) -> dict:
    torch.manual_seed(0)
    points = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        w32_t = w.t().contiguous()  # float32 runs transposed (llama.weight_layout_for)
        wbf = w.to(torch.bfloat16)
        q = {("int8", torch.bfloat16): int8_from_float(w, torch.bfloat16, keep_dense=False, max_rows=1 << 30),
             ("int4", torch.bfloat16): int4_from_float(w, torch.bfloat16, keep_dense=False, max_rows=1 << 30),
             ("int8", torch.float32): int8_from_float(w, torch.float32, keep_dense=False),
             ("int4", torch.float32): int4_from_float(w, torch.float32, keep_dense=False)}
        blocks = {}
        if block_gemm.available():  # forklm's AVX2 kernel on GGUF blocks (random values of the file's types;
            # since 2026-11-28 both run interleaved, q4_1_r8 / q8_0_r8: the labels keep the types' names)
            nb = k // 32
            d = (torch.rand(n, nb) * 0.01).half().float()
            blocks["q4_1"] = BlockQuantized("q4_1", torch.randint(0, 16, (n, k), dtype=torch.uint8), d,
                                            (-torch.rand(n, nb) * 0.1).half().float()).to_block_weights()
            blocks["q8_0"] = BlockQuantized("q8_0", torch.randint(-127, 128, (n, k), dtype=torch.int8), d).to_block_weights()
        for T in rows:
            x32 = torch.randn(T, k)
            xbf = x32.to(torch.bfloat16)
            p = {"shape": name, "in": k, "out": n, "T": T,
                 "dense_float32": time_ms(lambda x=x32, w=w32_t: torch.matmul(x, w)),
                 "dense_float32_out_in": time_ms(lambda x=x32, w=w: F.linear(x, w)),
                 "dense_bfloat16": time_ms(lambda x=xbf, w=wbf: F.linear(x, w))}
            for kind, bw in blocks.items():  # float32 activations (quantized per row inside)
                p[f"block_{kind}"] = time_ms(lambda x=x32, bw=bw: block_gemm.gemm(x, bw))
            for kind in ("int8", "int4"):
                ql = q[(kind, torch.bfloat16)]
                p[f"{kind}_bfloat16"] = time_ms(lambda x=xbf, ql=ql: ql.kernel(x))
                ref = xbf.double() @ ql.dequantize().double().t()
                p[f"{kind}_bfloat16_rel_err"] = float((ql.kernel(xbf).double() - ref).norm() / ref.norm())
                # a float32 model's call: activations rounded to bfloat16, the product widened back
                p[f"{kind}_float32_model"] = time_ms(lambda x=x32, ql=ql: ql(x))
                if T in float32_kernel_rows:
                    ql32 = q[(kind, torch.float32)]
                    p[f"{kind}_float32"] = time_ms(lambda x=x32, ql=ql32: ql.kernel(x), min_time=0.05, max_reps=10)
            points.append(p)
            print(" ".join(f"{key}={v:.3f}" if isinstance(v, float) and "err" not in key else f"{key}={v}"
                           for key, v in p.items() if "err" not in key), flush=True)
    return {"machine": machine_info(), "threads": torch.get_num_threads(), "points": points}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64,256")
    ap.add_argument("--float32-kernel-rows", default="1,8", help="T at which the (slow) float32 kernels are timed")
    ap.add_argument("--out", default="bench/results/quant_kernels_cpu.json")
    args = ap.parse_args(argv)
    result = run([int(r) for r in args.rows.split(",")], [int(r) for r in args.float32_kernel_rows.split(",")])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
