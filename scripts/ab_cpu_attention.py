"""The C++ decode attention of this tree against the one of another commit, side by side.

    python scripts/ab_cpu_attention.py --against <commit> [--points 2048x32,2048x16,2048x8,256x32]
        [--rounds 15] [--shape g,p,D] [--out bench/results/cpu_attention_ab.json]

Builds csrc/paged_attention.cpp as it is at `--against` (with that commit's simd_math.h) beside
this tree's build, and per point (m_c x n) times a decode step's calls of each on the default model's
shapes (30 layers, each its own cache: 3 KV heads x 3 query heads each, head dim 64, or `--shape`;
float16 cache, blocks of 16; the caches evicted from the CPU's caches before each step, as a step's weights evict
them): a shared prompt of m_c tokens read by n rows, each row with its own 5-token tail; rounds
interleaved, each round's mean of 10 steps per layer, the minimum and median over rounds reported. `--layers 1 --no-evict`
times one layer's cache kept in cache. Checks the two builds' outputs are equal bit for bit (with
`--other-bits`, for a change of the arithmetic's order: within float32 rounding of each other).
Run it alone (`flock /tmp/forklm_bench.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: its bench/ package
from bench.machine import machine_info  # noqa: E402
from forklm.kernels import block_gemm as bg  # noqa: E402
from forklm.kernels import cpu_attention as ca  # noqa: E402
from forklm.kernels.segment_attention import SegmentItem  # noqa: E402

CSRC = "forklm/kernels/csrc"


def build_at(commit: str, root: Path, source: str = "paged_attention.cpp", extra_cflags: tuple[str, ...] = ()):
    """Builds csrc/`source` as it is at `commit` (with that commit's simd_math.h); (module, short sha)."""
    tmp = Path(tempfile.mkdtemp(prefix="forklm_ab_"))
    for name in (source, "simd_math.h"):
        text = subprocess.run(["git", "show", f"{commit}:{CSRC}/{name}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        (tmp / name).write_text(text)
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=root, check=True, capture_output=True,
                         text=True).stdout.strip()
    tag = "".join(c for c in "_".join(extra_cflags) if c.isalnum())[:24]
    return bg.load_cpu_extension(f"forklm_ab_{Path(source).stem}_{sha}{tag}", tmp / source, extra_cflags), sha


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the commit whose attention to time beside this tree's")
    ap.add_argument("--points", default="2048x32,2048x16,2048x8,256x32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30, help="layers a step calls, each with its own cache")
    ap.add_argument("--no-evict", action="store_true", help="leave the caches in the CPU's caches between steps")
    ap.add_argument("--shape", default="3,3,64",
                    help="g,p,D: KV heads, query heads per KV head, head dim (default SmolLM2-135M's; "
                         "Llama-3.2-1B 8,4,64; Qwen2.5-1.5B 2,6,128)")
    ap.add_argument("--other-bits", action="store_true",
                    help="the two may round differently (a change of the sums' order): check them within 2e-6")
    ap.add_argument("--out", default="bench/results/cpu_attention_ab.json")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    evict = torch.ones(64 << 20, dtype=torch.uint8)  # larger than the last-level cache of the CPUs we run on
    root = Path(__file__).resolve().parent.parent
    old, sha = build_at(args.against, root)
    new = ca._extension()
    g, p, D = (int(v) for v in args.shape.split(","))
    bs, tail = 16, 5
    results = {}
    for point in args.points.split(","):
        ctx, rows = (int(v) for v in point.split("x"))
        nb = ctx // bs + rows + 2
        caches = [(torch.randn(g, nb * bs, D).half(), torch.randn(g, nb * bs, D).half()) for _ in range(args.layers)]
        items = [SegmentItem(list(range(rows)), list(range(ctx // bs)), ctx)]
        items += [SegmentItem([r], [ctx // bs + r], tail) for r in range(rows)]
        plan = ca.plan_items(items, rows, bs)
        q = torch.randn(rows, g * p, D)

        def call(ext, k, v, q=q, plan=plan, rows=rows):
            return ext.paged_attention(q, None, None, k, v, None, g * p, rows, plan.rows_start, plan.rows,
                                       plan.blocks_start, plan.blocks, plan.tokens, bs, D ** -0.5, ca.CHUNK_TOKENS)

        a, b = call(old, *caches[0]), call(new, *caches[0])
        if args.other_bits:
            err = ((a.double() - b.double()).norm() / a.double().norm()).item()
            if not err < 2e-6:
                raise AssertionError(f"{point}: this tree's attention is {err:.2e} from {sha}'s")
        elif not torch.equal(a, b):
            raise AssertionError(f"{point}: this tree's attention gives other bits than {sha}'s")
        times = {sha: [], "this tree": []}
        for _ in range(args.rounds):
            for name, ext in ((sha, old), ("this tree", new)):
                total = 0.0
                for _ in range(10):
                    if not args.no_evict:
                        evict.add_(1)
                    t = time.perf_counter()
                    for k, v in caches:
                        call(ext, k, v)
                    total += time.perf_counter() - t
                times[name].append(total / (10 * args.layers) * 1e3)
        results[point] = {name: {"ms_min": min(t), "ms_median": statistics.median(t)} for name, t in times.items()}
        print(point, ", ".join(f"{name} {r['ms_min']:.3f} / {r['ms_median']:.3f} ms (min / median, one layer)"
                               for name, r in results[point].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "against": sha, "rounds": args.rounds, "layers": args.layers,
                                          "shape": {"kv_heads": g, "query_heads_per_kv_head": p, "head_dim": D},
                                          "evicted": not args.no_evict, "points": results},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
