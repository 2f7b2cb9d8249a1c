"""The block kernel's AMX tiles against its vector tiles (the same VNNI build), on a decode step's products.

    python scripts/ab_amx.py [--model FILE.gguf] [--rows 1,4,8,16,32,64] [--rounds 9]
        [--out bench/results/block_kernel_amx_ab.json]

Loads a model (default: the packaged SmolLM2 Q4_1), takes every product of one decode step (each layer's
q/k/v, o, gate/up and down, and the LM head, each part of a fused matrix on its own), and times them on
random activations of `rows` rows with the tiles off and on (`set_amx`), rounds interleaved: minimum and
median of the step's products for each, and per layout. Checks that both give the same bits. Needs a CPU
with AMX-INT8. Run it alone (`flock /tmp/forklm_bench.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: its bench/ package
from bench.machine import cpu_model, machine_info
from forklm.kernels import block_gemm as bg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64", help="activation rows per product (a step's samples)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged SmolLM2 Q4_1)")
    ap.add_argument("--out", default="bench/results/block_kernel_amx_ab.json")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time on one thread (for a machine busy with other work)")
    args = ap.parse_args(argv)
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.process_time
    from forklm import LLM

    ext = bg._extension()
    if not ext.amx_supported():
        raise SystemExit("this CPU (or this build, or Linux) runs no AMX tiles")
    model = (LLM(args.model) if args.model else LLM()).model

    def parts(w):  # a BlockLinear's layouts (one, or one per run of parts fused along the outputs)
        return list(getattr(w, "parts", None) or [w.blocks])

    mats = [b for layer in model.layers for k in ("qkv", "o", "gate_up", "down") for b in parts(layer[k])]
    mats += parts(model.lm_head)
    mats = [b for b in mats if hasattr(b, "kernel_arrays")]
    kinds = sorted({b.kind for b in mats})

    def product(b, x):
        return getattr(ext, f"gemm_{b.kind}")(x, *b.kernel_arrays(), 0, None, 0.0, None)

    results = {}
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, b.k) for b in mats]

            def step(on, xs=xs):
                ext.set_amx(on)
                per_kind = dict.fromkeys(kinds, 0.0)
                outs = []
                for b, x in zip(mats, xs):
                    t = clock()
                    outs.append(product(b, x))
                    per_kind[b.kind] += (clock() - t) * 1e3
                return sum(per_kind.values()), per_kind, outs

            off, on = step(False)[2], step(True)[2]
            if not all(torch.equal(a, b) for a, b in zip(off, on)):
                raise AssertionError(f"the AMX tiles' products differ from the vector tiles' at {rows} rows")
            times = {False: [], True: []}
            kind_times = {False: {k: [] for k in kinds}, True: {k: [] for k in kinds}}
            for _ in range(args.rounds):
                for amx in (False, True):
                    total, per_kind, _ = step(amx)
                    times[amx].append(total)
                    for k, v in per_kind.items():
                        kind_times[amx][k].append(v)
            results[rows] = {
                name: {"ms_min": min(times[amx]), "ms_median": statistics.median(times[amx]),
                       "per_layout_ms_median": {k: statistics.median(v) for k, v in kind_times[amx].items()}}
                for name, amx in (("vector", False), ("amx", True))}
            v, a = results[rows]["vector"]["ms_median"], results[rows]["amx"]["ms_median"]
            per = ", ".join(f"{k} {results[rows]['vector']['per_layout_ms_median'][k] / max(results[rows]['amx']['per_layout_ms_median'][k], 1e-9):.2f}x"
                            for k in kinds)
            print(f"{rows} rows: vector {v:.2f} ms, AMX {a:.2f} ms (medians, a step's products): {v / a:.2f}x ({per})",
                  flush=True)
    finally:
        ext.set_amx(True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "machine": machine_info(), "threads": torch.get_num_threads(),
                               "clock": args.clock, "model": str(args.model or "default"), "layouts": kinds,
                               "amx_min_rows": ext.AMX_MIN_ROWS, "rounds": args.rounds, "rows": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
