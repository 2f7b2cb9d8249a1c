"""Checks the Triton decode-attention kernel on a GPU (scripts/gpu_run.sh runs it, then times it).

    python scripts/gpu_check.py --out "$OUT/kernel_check.json"          # on the device machine

Part 1 (correctness): random sharing structures (a prefix shared by all rows, groups, own tails,
lengths not multiples of the block size, scattered blocks) for g = h, 1 < g < h, g = 1;
b in {1, 3, 64}; head dims 64 and 128; float16 and bfloat16 (the interpreter cannot check
bfloat16 `tl.dot`); outputs poisoned with NaN first; compared with float32 materialized attention.
Every case is recorded, failures included, so one bad case does not lose the rest. Writes JSON;
exits 1 if any case failed. Timing: `python -m bench kernel` (bench/kernel_bench.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_bench import random_sharing, reference_attention  # noqa: E402
from forklm.kernels.segment_attention import plan_segments, segment_attention  # noqa: E402


def check(args) -> list[dict]:
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        for h, g in ((32, 32), (32, 8), (32, 1)):
            for b in (1, 3, 64):
                for D in (64, 128):
                    rec = {"dtype": str(dtype).split(".")[-1], "h": h, "g": g, "b": b, "D": D}
                    try:
                        rng = random.Random(zlib.crc32(repr((h, g, b, D, str(dtype))).encode()))
                        bs, nb = 16, 4000
                        items = random_sharing(rng, b, bs, nb, max_shared=3000, max_group=300, max_own=100)
                        kc = torch.randn(g, nb * bs, D, device="cuda", dtype=dtype)
                        vc = torch.randn(g, nb * bs, D, device="cuda", dtype=dtype)
                        q = torch.randn(b, h, D, device="cuda", dtype=dtype)
                        plan = plan_segments(items, b, h, g, bs, "cuda")
                        o = torch.full((b, h, D), float("nan"), device="cuda", dtype=dtype)
                        lse = torch.full((b, h), float("nan"), device="cuda")
                        segment_attention(q, kc, vc, plan, D**-0.5, out=o, out_lse=lse)
                        torch.cuda.synchronize()
                        ref, _ = reference_attention(q, kc, vc, items, bs, D**-0.5, dtype=torch.float32)
                        rec["finite"] = bool(torch.isfinite(o).all() and torch.isfinite(lse).all())
                        rec["rel_err"] = ((o.float() - ref).norm() / ref.norm()).item()
                        rec["ok"] = rec["finite"] and rec["rel_err"] < (2e-2 if dtype == torch.bfloat16 else 3e-3)
                    except Exception as e:  # noqa: BLE001 - recorded
                        rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"
                        rec["trace"] = traceback.format_exc()[-2000:]
                    out.append(rec)
                    print("check", rec.get("ok"), {k: v for k, v in rec.items() if k != "trace"}, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="kernel.json")
    args = p.parse_args()
    t0 = time.time()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    doc["check"] = check(args)
    doc["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(doc, indent=1))
    bad = [c for c in doc["check"] if not c.get("ok")]
    print(f"{len(doc['check']) - len(bad)}/{len(doc['check'])} checks ok; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
