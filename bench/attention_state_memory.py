"""Peak memory and time of one prefill chunk's attention at a long position, on the C++ kernel, with the
chunk states' budget at its default against an unbounded one (every row in one group).

    .venv/bin/python -m bench.attention_state_memory --position 32768 --rows 512 --out bench/results/x.json

Each budget runs in a fresh process (peak RSS is per process); the shape is an 8B Llama's (32 query
heads, 8 KV heads, head dim 128), the cache float32; rows in block b read blocks [0, b) as one item, then
their own block, as the engine's prefill plans do."""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(position: int, rows: int, budget: int | None, repeats: int) -> dict:
    import torch

    from forklm.kernels import cpu_attention as ca
    from forklm.kernels.segment_attention import SegmentItem

    h, g, D, bs = 32, 8, 128, 16
    total = position + rows
    nb = -(-total // bs)
    torch.manual_seed(0)
    k, v = torch.randn(g, nb * bs, D), torch.randn(g, nb * bs, D)
    q = torch.randn(rows, h, D)
    prefixes, own = [], []
    for b in range(position // bs, -(-total // bs)):  # position >= bs: every block's rows read blocks [0, b)
        r0, r1 = max(b * bs, position) - position, min((b + 1) * bs, total) - position
        prefixes.append(SegmentItem(list(range(r0, r1)), list(range(b)), b * bs))
        own += [SegmentItem([r], [b], position + r + 1 - b * bs) for r in range(r0, r1)]
    items = prefixes + own
    plan = ca.plan_items(items, rows, bs)
    if budget is not None:
        ca.set_state_budget_bytes(budget)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        ca.paged_attention(q, k, v, plan, h)
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"budget_bytes": ca.state_budget_bytes(), "median_s": statistics.median(times), "times_s": times,
            "peak_rss_mib": peak / 1024, "rss_before_call_mib": base / 1024, "call_peak_mib": (peak - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--position", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(one(a.position, a.rows, None if a.child == "default" else int(a.child), a.repeats)))
        return
    from bench.machine import machine_info

    res = {"position": a.position, "rows": a.rows, "shape": "h 32, g 8, D 128, float32 cache",
           "machine": machine_info(), "runs": {}}
    for name, child in (("unbounded", str(1 << 62)), ("default", "default")):
        out = subprocess.run([sys.executable, "-m", "bench.attention_state_memory", "--position", str(a.position), "--rows", str(a.rows),
                              "--repeats", str(a.repeats), "--child", child], check=True, capture_output=True, text=True)
        res["runs"][name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
