"""Times one layer's decode attention, standard vs bifurcated, over a grid (the data behind `auto`).

Run: `python -m bench.attention_sweep --out bench/results/attention_sweep_cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from forklm.reference.forked_attention import DecodeAttention
from forklm.reference.forked_kv import ForkedKVCache


def time_path(path: str, b: int, m_c: int, own: int, g: int, p: int, D: int, dtype: torch.dtype, reps: int) -> float:
    cache = ForkedKVCache(1, g, D, m_c, own + 1, b, dtype, "cpu")
    cache.ctx_k[0].normal_()
    cache.ctx_v[0].normal_()
    cache.fork()
    cache.own_k[0].normal_()
    cache.own_v[0].normal_()
    cache.own_len = own
    q = torch.randn(b, g * p, D, dtype=dtype)
    k = torch.randn(b, g, D, dtype=dtype)
    v = torch.randn(b, g, D, dtype=dtype)
    attn = DecodeAttention(cache, path)
    times = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        attn.attend(0, q, k, v)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/attention_sweep_cpu.json")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--b", default="1,2,4,8,16,32,64")
    ap.add_argument("--m-c", default="16,64,256,1024,4096")
    ap.add_argument("--own", type=int, default=32)
    ap.add_argument("--heads", default="9,3,64", help="h,g,D (default: SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    h, g, D = (int(x) for x in a.heads.split(","))
    rows = []
    for dt_name in a.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for m_c in (int(x) for x in a.m_c.split(",")):
            for b in (int(x) for x in a.b.split(",")):
                r = {"dtype": dt_name, "m_c": m_c, "b": b, "own": a.own}
                for path in ("standard", "bifurcated"):
                    r[path + "_us"] = 1e6 * time_path(path, b, m_c, a.own, g, h // g, D, dt, a.reps)
                r["speedup"] = r["standard_us"] / r["bifurcated_us"]
                rows.append(r)
                print(f"{dt_name:9s} m_c={m_c:5d} b={b:3d} standard {r['standard_us']:9.1f} us  "
                      f"bifurcated {r['bifurcated_us']:9.1f} us  x{r['speedup']:.2f}", flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "shape": {"h": h, "g": g, "D": D}}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
