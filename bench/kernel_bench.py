"""`python -m bench kernel`: the Triton shared-segment decode-attention kernel against torch SDPA.

One attention layer: b samples share an m_c-token context and have `own` tokens each (decode: one
query token per sample). Per point (ms per call, median):
    kernel          forklm's kernel through the paged cache (context read once for all b)
    sdpa_copies     torch SDPA over per-sample K/V copies (what an engine without sharing does)
    sdpa_shared     torch SDPA over one context copy expanded to every sample (stride 0)
    floor           max(bytes once / bandwidth, FLOPs / matmul rate), both measured in the same run:
                    the context's K/V once, every sample's own K/V, q and the output
The kernel's output is checked against SDPA's at every point (rel_err). On a GPU, CUDA events
time each call; on CPU the kernel runs in Triton's interpreter (correctness smoke only; the
timings mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.floor import measure_bandwidth, measure_matmul_rate

SHAPES = {"llama3-8b": (32, 8, 128), "mha-32": (32, 32, 128)}  # (h, g, D)


def random_sharing(rng, b: int, block_size: int, num_blocks: int, max_shared: int = 300, max_group: int = 70,
                   max_own: int = 40) -> list:
    """Random work items for checking the kernel: a prefix shared by all b rows, a middle level
    shared by random groups, each row's own tail; lengths not multiples of the block size; blocks
    drawn from a shuffled pool, so segments are scattered."""
    from forklm.kernels.segment_attention import SegmentItem

    free = list(range(num_blocks))
    rng.shuffle(free)

    def segment(rows, hi):
        n = rng.randint(1, hi)
        return SegmentItem(rows, [free.pop() for _ in range(-(-n // block_size))], n)

    rows = list(range(b))
    items = [segment(rows, max_shared)]
    rng.shuffle(rows)
    k = 0
    while k < b:
        size = rng.randint(1, max(1, b // 2))
        if rng.random() < 0.7:
            items.append(segment(sorted(rows[k : k + size]), max_group))
        k += size
    items += [segment([r], max_own) for r in range(b) if rng.random() < 0.9]
    return items


def reference_attention(q, k_cache, v_cache, items, block_size: int, scale: float, dtype=torch.float64):
    """Per row: its keys materialized from all its items, softmax, weighted sum, in `dtype`.
    Returns (o [R, h, D], lse [R, h])."""
    R, h, D = q.shape
    g = k_cache.shape[0]
    o = torch.empty(R, h, D, dtype=dtype, device=q.device)
    lse = torch.empty(R, h, dtype=dtype, device=q.device)
    for r in range(R):
        slots = torch.tensor([it.blocks[t // block_size] * block_size + t % block_size
                              for it in items if r in it.rows for t in range(it.num_tokens)], device=q.device)
        kk = k_cache[:, slots].to(dtype).repeat_interleave(h // g, 0)  # [h, S, D]
        vv = v_cache[:, slots].to(dtype).repeat_interleave(h // g, 0)
        s = torch.einsum("hd,hsd->hs", q[r].to(dtype), kk) * scale
        lse[r] = torch.logsumexp(s, -1)
        o[r] = torch.einsum("hs,hsd->hd", torch.softmax(s, -1), vv)
    return o, lse


def _time_ms(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_point(shape: str, h: int, g: int, D: int, m_c: int, b: int, own: int, dtype: torch.dtype,
               device: torch.device, bandwidth: float, matmul_rate: float, block_size: int = 16,
               reps: int = 20) -> dict:
    from forklm.kernels.segment_attention import SegmentItem, plan_segments, segment_attention

    rec: dict = {"shape": shape, "h": h, "g": g, "D": D, "m_c": m_c, "b": b, "own": own}
    bs = block_size
    ctx_blocks, own_blocks = -(-m_c // bs), -(-own // bs)
    nb = ctx_blocks + b * own_blocks
    k_cache = torch.randn(g, nb * bs, D, device=device, dtype=dtype)
    v_cache = torch.randn(g, nb * bs, D, device=device, dtype=dtype)
    q = torch.randn(b, h, D, device=device, dtype=dtype)
    items = [SegmentItem(list(range(b)), list(range(ctx_blocks)), m_c)]
    items += [SegmentItem([r], list(range(ctx_blocks + r * own_blocks, ctx_blocks + (r + 1) * own_blocks)), own)
              for r in range(b)]
    plan = plan_segments(items, b, h, g, bs, device)
    scale = D**-0.5
    rec["kernel_ms"] = _time_ms(lambda: segment_attention(q, k_cache, v_cache, plan, scale), device, reps)
    out, _ = segment_attention(q, k_cache, v_cache, plan, scale)
    e = k_cache.element_size()
    bytes_once = 2 * g * D * e * (m_c + b * own) + 2 * b * h * D * e
    flops = 4 * b * h * D * (m_c + own)
    rec["floor_ms"] = max(bytes_once / bandwidth, flops / matmul_rate) * 1e3
    rec["x_floor"] = rec["kernel_ms"] / rec["floor_ms"]

    # SDPA references: keys = the context then the sample's own tokens
    qh = q.view(b, h, 1, D)
    ctx_k = k_cache[:, : m_c].unsqueeze(0)  # context blocks are the first ctx_blocks, in order
    ctx_v = v_cache[:, : m_c].unsqueeze(0)
    own_idx = torch.cat([torch.arange((ctx_blocks + r * own_blocks) * bs, (ctx_blocks + r * own_blocks) * bs + own)
                         for r in range(b)]).to(device)
    own_k = k_cache.index_select(1, own_idx).view(g, b, own, D).transpose(0, 1)
    own_v = v_cache.index_select(1, own_idx).view(g, b, own, D).transpose(0, 1)
    try:
        ks = torch.cat([ctx_k.expand(b, g, m_c, D), own_k], 2).contiguous()  # per-sample copies
        vs = torch.cat([ctx_v.expand(b, g, m_c, D), own_v], 2).contiguous()
        rec["sdpa_copies_ms"] = _time_ms(lambda: F.scaled_dot_product_attention(qh, ks, vs, enable_gqa=True),
                                         device, reps)
        ref = F.scaled_dot_product_attention(qh, ks, vs, enable_gqa=True).view(b, h, D).float()
        rec["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
        rec["speedup_vs_sdpa_copies"] = rec["sdpa_copies_ms"] / rec["kernel_ms"]
        del ks, vs, ref
    except torch.OutOfMemoryError:
        rec["sdpa_copies_ms"] = None  # b copies of the context do not fit
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # one shared copy of the context, read by every sample: two segments merged by log-sum-exp
    # would be forklm's own trick, so here SDPA gets the concatenation built per call from the
    # expanded view (what a paged engine without a shared-prefix kernel reads)
    def shared() -> torch.Tensor:
        k = torch.cat([ctx_k.expand(b, g, m_c, D), own_k], 2)
        v = torch.cat([ctx_v.expand(b, g, m_c, D), own_v], 2)
        return F.scaled_dot_product_attention(qh, k, v, enable_gqa=True)

    try:
        rec["sdpa_shared_ms"] = _time_ms(shared, device, reps)
    except torch.OutOfMemoryError:
        rec["sdpa_shared_ms"] = None
    return rec


def build_parser(sub=None) -> argparse.ArgumentParser:
    kw = dict(help="the Triton decode-attention kernel vs torch SDPA, with the floor",
              description=__doc__.split("\n\n")[0])
    p = sub.add_parser("kernel", **kw) if sub is not None else argparse.ArgumentParser(description=kw["description"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default="llama3-8b,mha-32", help=f"of {list(SHAPES)}, or h:g:D")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--own", type=int, default=64, help="own tokens per sample (default: 64)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/kernel_<device>_<dtype>.json)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    if args.device == "cpu":  # Triton's interpreter; must be chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from forklm.kernels.segment_attention import available

    if not available():
        raise ValueError("bench kernel needs triton (pip install triton)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    dtype = getattr(torch, args.dtype)
    bw, _ = measure_bandwidth(device)
    big = 8192 if device.type == "cuda" else 512
    rate = max(measure_matmul_rate(dtype, device, [(big, big, big)]).values())
    shapes = []
    for s in args.shapes.split(","):
        shapes.append((s, *SHAPES[s]) if s in SHAPES else (s, *map(int, s.split(":"))))
    points = []
    for name, h, g, D in shapes:
        for m_c in map(int, args.contexts.split(",")):
            for b in map(int, args.batches.split(",")):
                try:
                    rec = time_point(name, h, g, D, m_c, b, args.own, dtype, device, bw, rate, reps=args.reps)
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    rec = {"shape": name, "m_c": m_c, "b": b, "error": f"{type(e).__name__}: {e}"}
                points.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    doc = {"meta": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "dtype": args.dtype, "torch": torch.__version__, "bandwidth_GBps": bw / 1e9,
                    "matmul_TFLOPs": rate / 1e12, "own": args.own, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
           "points": points}
    out = Path(args.out or f"bench/results/kernel_{device.type}_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(markdown_table(doc))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def markdown_table(doc: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    lines = ["| shape | m_c | b | kernel ms | SDPA copies ms | SDPA shared ms | floor ms | kernel / floor | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in doc["points"]:
        if "error" in p:
            lines.append(f"| {p['shape']} | {p['m_c']} | {p['b']} | error: {p['error'][:60]} | | | | | |")
            continue
        lines.append(f"| {p['shape']} | {p['m_c']} | {p['b']} | {ms(p['kernel_ms'])} | {ms(p.get('sdpa_copies_ms'))} | "
                     f"{ms(p.get('sdpa_shared_ms'))} | {ms(p['floor_ms'])} | {p['x_floor']:.1f}x | "
                     f"{p.get('rel_err', float('nan')):.1e} |")
    return "\n".join(lines)
