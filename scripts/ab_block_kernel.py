"""The block kernel of this tree against the one of another commit, on a decode step's products.

    python scripts/ab_block_kernel.py --against <commit> [--model FILE.gguf] [--rows 1,8,32] [--rounds 15]
        [--out bench/results/block_kernel_ab.json] [--same-bits]

Builds csrc/block_gemm.cpp as it is at `--against` beside this tree's (the AVX2 build of each and,
on CPUs with AVX512-VNNI, the VNNI build of each), loads the default model and runs the 121
products of one decode step (30 layers x q/k/v, o, gate/up, down, and the Q8_0 LM head, each on its
own random activations of `rows` rows) through every build, rounds interleaved; minimum and median
of the step's products per build. Checks that this tree's builds agree bit for bit and stay within
1e-5 of `gemm_reference`. A commit from before the Q4_1 minima's grouped layout gets them as
[N, K/32]; one from before an interleaved layout runs those blocks as it loaded them (Q8_0 read as the
file stores it where the build has that, else the plain layouts). Run it alone (`flock /tmp/forklm_bench.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: its bench/ package
from ab_cpu_attention import build_at

from bench.machine import machine_info
from forklm.kernels import block_gemm as bg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the commit whose block kernel to time beside this tree's")
    ap.add_argument("--rows", default="1,8,32", help="activation rows per product (a step's samples)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged SmolLM2 Q4_1)")
    ap.add_argument("--out", default="bench/results/block_kernel_ab.json")
    ap.add_argument("--same-bits", action="store_true",
                    help="also require this tree's products to equal the other commit's bit for bit")
    args = ap.parse_args(argv)
    from forklm import LLM

    root = Path(__file__).resolve().parent.parent
    flag_sets = {"avx2": ()} | ({"vnni": bg._VNNI_CFLAGS} if bg.uses_vnni() else {})
    builds = {}
    for build, flags in flag_sets.items():
        old, sha = build_at(args.against, root, "block_gemm.cpp", flags)
        builds[f"{sha} {build}"] = (old, None)
        builds[f"this tree {build}"] = (bg.load_cpu_extension(f"forklm_ab_block_gemm_this{build}", bg._SOURCE, flags),
                                        None)
    model = (LLM(args.model) if args.model else LLM()).model

    def parts(w):  # a BlockLinear's layouts (one, or one per run of parts fused along the outputs)
        return list(getattr(w, "parts", None) or [w.blocks])

    mats = [b for layer in model.layers for k in ("qkv", "o", "gate_up", "down") for b in parts(layer[k])]
    mats += parts(model.lm_head)
    flat_minima = [None if b.m is None else bg.unblock_minima(b.m, b.n).contiguous() for b in mats]
    # a build from before the interleaved 4-bit layouts runs those blocks in the plain q4_1 layout
    plain = {id(b): bg.deinterleave_r8(b) for b in mats if b.kind in getattr(bg, "R8_KINDS", ())}
    flat_plain = {i: bg.unblock_minima(p.m, p.n).contiguous() for i, p in plain.items() if p.m is not None}

    def as_stored(b):  # Q8_0 blocks as the file stores them, for a build that read them there (gemm_q8_0_stored:
        # each output row's address, the width); the stored bytes are kept beside the addresses
        raw = torch.cat([b.d.contiguous().view(torch.uint8).view(b.n, -1, 2), b.qs.view(torch.uint8).view(b.n, -1, 32)], -1)
        raw = raw.view(b.n, -1).contiguous()
        return raw, raw.data_ptr() + torch.arange(b.n) * raw.stride(0), torch.tensor([b.k], dtype=torch.int64)

    stored = {i: as_stored(p) for i, p in plain.items() if p.kind == "q8_0"}
    q4 = next((b for b in mats if b.kind == "q4_1"), next((p for p in plain.values() if p.kind == "q4_1"), None))
    for name, (ext, old) in builds.items():  # which minima layout each build takes
        try:
            if q4 is not None:
                ext.gemm_q4_1(torch.randn(1, q4.k), q4.qs, q4.d, q4.m, 0, None, 0.0, None)
            builds[name] = (ext, False)
        except RuntimeError:  # a kernel from before the grouped layout: minima [N, K/32]
            builds[name] = (ext, True)

    def product(ext, flat_layout, b, flat, x):
        if id(b) in stored and not hasattr(ext, f"gemm_{b.kind}") and hasattr(ext, "gemm_q8_0_stored"):
            _, rows, width = stored[id(b)]
            return ext.gemm_q8_0_stored(x, rows, width, 0, None, 0.0, None)
        if id(b) in plain and not hasattr(ext, f"gemm_{b.kind}"):
            b, flat = plain[id(b)], flat_plain.get(id(b))
        if b.kind == "q4_1" and flat_layout:
            return ext.gemm_q4_1(x, b.qs, b.d, flat, 0, None, 0.0, None)
        return getattr(ext, f"gemm_{b.kind}")(x, *b.kernel_arrays(), 0, None, 0.0, None)

    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, b.k) for b in mats]

        def step(ext, flat_layout, xs=xs):
            t = time.perf_counter()
            outs = [product(ext, flat_layout, b, f, x) for b, f, x in zip(mats, flat_minima, xs)]
            return (time.perf_counter() - t) * 1e3, outs

        ours = [step(ext, flat)[1] for name, (ext, flat) in builds.items() if name.startswith("this tree")]
        split = getattr(bg, "K_R8_KINDS", ())  # (the builds quantize these layouts' activations differently)
        if not all(torch.equal(a, b) for a, b, m in zip(ours[0], ours[-1], mats) if m.kind not in split):
            raise AssertionError("this tree's builds disagree")
        if args.same_bits:
            theirs = next(step(ext, flat)[1] for name, (ext, flat) in builds.items() if not name.startswith("this tree"))
            if not all(torch.equal(a, b) for a, b in zip(ours[0], theirs)):
                raise AssertionError(f"this tree's products differ from {sha}'s at {rows} rows")
        worst = max(((o - bg.gemm_reference(x, b, vnni=False)).norm() / bg.gemm_reference(x, b, vnni=False).norm()).item()
                    for o, b, x in zip(ours[0][:8], mats, xs))
        if worst > 1e-5:
            raise AssertionError(f"this tree's products are {worst:.2e} from the reference")
        times = {name: [] for name in builds}
        for _ in range(args.rounds):
            for name, (ext, flat) in builds.items():
                times[name].append(step(ext, flat)[0])
        results[rows] = {name: {"ms_min": min(t), "ms_median": statistics.median(t)} for name, t in times.items()}
        print(f"{rows} rows:", ", ".join(f"{name} {r['ms_min']:.2f} / {r['ms_median']:.2f} ms"
                                         for name, r in results[rows].items()), "(min / median, a step's products)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "against": sha,
                               "model": str(args.model or "default"), "layouts": sorted({b.kind for b in mats}),
                               "rounds": args.rounds, "rows": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
