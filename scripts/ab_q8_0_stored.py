"""Q8_0 read where the file stores it against the same blocks repacked, on a decode step's products.

    python scripts/ab_q8_0_stored.py --model FILE.gguf [--rows 1,8,32] [--rounds 9]
        [--out bench/results/q8_0_stored_ab.json]

Loads the model (its Q8_0 tensors on `gemm_q8_0_stored`, reading the mapped file), copies each of
them into the separate values / scales layout of `gemm_q8_0` (what loading did before), checks
that both give the same bits, and times one decode step's products (every Q8_0 product of the
model, each on its own random activations of `rows` rows) on each, rounds interleaved; minimum and
median per layout. Run it alone (`flock /tmp/forklm_bench.lock ...`).
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
from bench.machine import machine_info
from forklm.kernels import block_gemm as bg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file with Q8_0 tensors")
    ap.add_argument("--rows", default="1,8,32", help="activation rows per product (a step's samples)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="bench/results/q8_0_stored_ab.json")
    args = ap.parse_args(argv)
    from forklm import LLM

    model = LLM(args.model).model
    linears = [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
    stored = [p for w in linears for p in getattr(w, "parts", []) if p.kind == "q8_0_stored"]
    if not stored:
        raise SystemExit(f"{args.model}: no Q8_0 product runs on the stored layout")
    repacked = [bg.pack_q8_0(*b.unpack()[:2]) for b in stored]
    layouts = {"stored": stored, "repacked": repacked}
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, b.k) for b in stored]
        outs = {name: [bg.gemm(x, b) for b, x in zip(mats, xs)] for name, mats in layouts.items()}
        if not all(torch.equal(a, b) for a, b in zip(outs["stored"], outs["repacked"])):
            raise AssertionError("the stored and repacked layouts disagree")
        times = {name: [] for name in layouts}
        for _ in range(args.rounds):
            for name, mats in layouts.items():
                t = time.perf_counter()
                for b, x in zip(mats, xs):
                    bg.gemm(x, b)
                times[name].append((time.perf_counter() - t) * 1e3)
        results[rows] = {name: {"ms_min": min(t), "ms_median": statistics.median(t)} for name, t in times.items()}
        print(f"{rows} rows:", ", ".join(f"{name} {r['ms_min']:.2f} / {r['ms_median']:.2f} ms"
                                         for name, r in results[rows].items()), "(min / median, the Q8_0 products of a step)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "model": args.model,
                               "products": len(stored), "rounds": args.rounds, "rows": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
