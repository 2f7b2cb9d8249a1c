"""The block kernel's builds side by side on a decode step's products (A/B of compile-time choices).

    python -m bench.block_kernel_variants [--rows 1] [--rounds 15] [--variants one-row|multi-row]
        [--out bench/results/block_kernel_variants_cpu.json]

Builds csrc/block_gemm.cpp in several variants (the AVX2 build; on CPUs with AVX512-VNNI the VNNI
build; each with 1 or 4 outputs per tile of a lone row, FORKLM_ONE_ROW_TILE_OUTS, and with the
lone row's Q4_1 products on `one_row_q4_1`, FORKLM_ONE_ROW_DIRECT, the default; or, with
`--variants multi-row`, with tiles of 2-4 rows on `tile` or `paired_tile`, FORKLM_PAIRED_ROWS), loads the
default model and runs the 121 products of one decode step (30 layers x q/k/v, o, gate/up, down,
and the LM head, each on its own random activations of `--rows` rows) through every variant,
rounds interleaved, checking that all variants give the same bits. Reports the minimum and median
over rounds of the whole step's products and of the layers' alone. Run it alone
(`flock /tmp/forklm_bench.lock ...`): this VM's run-to-run spread is 10-20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info


def variants(choice: str = "one-row") -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (extension name, extra compiler flags). choice "one-row": a lone row's tiles
    (FORKLM_ONE_ROW_TILE_OUTS 1 / 4, FORKLM_ONE_ROW_DIRECT); "multi-row": tiles of 2-4 rows on
    `tile` or `paired_tile` (FORKLM_PAIRED_ROWS 0 / 1)."""
    from forklm.kernels import block_gemm as bg

    out = {}
    builds = [("avx2", ())] + ([("vnni", bg._VNNI_CFLAGS)] if bg.uses_vnni() else [])
    for build, flags in builds:
        if choice == "tile-shape":
            for rows, outs in ((4, 0), (8, 1), (12, 1), (16, 1)):
                shape = (f"-DFORKLM_PAIRED_TILE_ROWS={rows}",) + ((f"-DFORKLM_PAIRED_TILE_OUTS={outs}",) if outs else ())
                out[f"{build}_paired_{rows}x{outs or 'default'}"] = (f"forklm_bgv_{build}_pt{rows}x{outs}", (*flags, *shape))
            continue
        if choice == "multi-row":
            for paired in (0, 1):
                out[f"{build}_paired_rows_{paired}"] = (f"forklm_bgv_{build}_paired{paired}",
                                                        (*flags, f"-DFORKLM_PAIRED_ROWS={paired}"))
            continue
        for outs in (1, 4):
            out[f"{build}_one_row_tile_{outs}"] = (f"forklm_bgv_{build}_t{outs}",
                                                   (*flags, f"-DFORKLM_ONE_ROW_TILE_OUTS={outs}", "-DFORKLM_ONE_ROW_DIRECT=0"))
        out[f"{build}_one_row_direct"] = (f"forklm_bgv_{build}_direct", (*flags, "-DFORKLM_ONE_ROW_DIRECT=1"))
    return out


def run(rows: int, rounds: int, choice: str = "one-row") -> dict:
    from forklm import LLM
    from forklm.kernels import block_gemm as bg

    m = LLM().model
    mats = [layer[k] for layer in m.layers for k in ("qkv", "o", "gate_up", "down")] + [m.lm_head]
    exts = {name: bg.load_cpu_extension(ext, bg._SOURCE, flags) for name, (ext, flags) in variants(choice).items()}
    xs = [torch.randn(rows, w.in_features) for w in mats]

    def step(ext, ws) -> tuple[float, list[torch.Tensor]]:
        t = time.perf_counter()
        outs = []
        for w, x in zip(ws, xs):
            b = w.blocks
            outs.append(ext.gemm_q4_1(x, b.qs, b.d, b.m, 0, None, 0.0, None) if b.kind == "q4_1"
                        else ext.gemm_q8_0(x, b.qs, b.d, 0, None, 0.0, None))
        return (time.perf_counter() - t) * 1e3, outs

    times = {n: {"all_ms": [], "layers_ms": []} for n in exts}
    first = None
    for _ in range(rounds):
        for name, ext in exts.items():
            ms, outs = step(ext, mats)
            first = first or outs
            if not all(torch.equal(a, b) for a, b in zip(outs, first)):
                raise AssertionError(f"variant {name} gives other results than {next(iter(exts))}")
            times[name]["all_ms"].append(ms)
            times[name]["layers_ms"].append(step(ext, mats[:-1])[0])
    return {name: {k + suffix: f(v) for k, v in t.items() for suffix, f in (("_min", min), ("_median", statistics.median))}
            for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1, help="activation rows per product (a step's samples)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", choices=("one-row", "multi-row", "tile-shape"), default="one-row",
                    help="which compile-time choice to compare (a lone row's tiles, or tiles of 2-4 rows)")
    ap.add_argument("--out", default="bench/results/block_kernel_variants_cpu.json")
    args = ap.parse_args(argv)
    res = run(args.rows, args.rounds, args.variants)
    for name, r in res.items():
        print(f"{name:24s} step's products {r['all_ms_min']:.2f} ms min, {r['all_ms_median']:.2f} median; "
              f"layers {r['layers_ms_min']:.2f} / {r['layers_ms_median']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "rows": args.rows,
                               "variants_compared": args.variants, "rounds": args.rounds, "variants": res}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
