"""Decode attention over shared KV segments as one Triton kernel (plus an exact LSE merge).

Work comes as *items*: an item is a run of KV blocks (a segment of `num_tokens` tokens) and the
decode rows that read it. A shared prompt is one item whose rows are all the samples sharing
it; each sample's own tail is an item with one row. For each KV head j, an item's
M = rows · (h / g) query vectors go through the segment's keys in tiles with `tl.dot` (tensor
cores) and an online softmax, so the segment's K/V is read once for all its rows. Long segments
are split along the keys into several programs (flash-decoding) so that a small batch still
fills the GPU. Every program writes a partial output and its log-sum-exp; `merge_partials_into`
combines the partials of each (row, head) exactly (docs/design.md: lse = log Σ exp lse_s,
o = Σ exp(lse_s − lse) o_s).

The host builds a `SegmentPlan` (integer tables) once per engine step; every layer reuses it.
The K/V cache layout is the engine's (`cache/paged_kv.py`): per layer `[g, num_blocks·bs, D]`.

Triton is imported lazily: this module imports without it; `available()` says whether it runs.
On CPU, Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported) runs the same
kernel on CPU tensors; the tests use it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class SegmentItem:
    rows: Sequence[int]  # batch rows that read this segment
    blocks: Sequence[int]  # the segment's block ids, in order
    num_tokens: int  # tokens of the segment (the last block may be partial)


@dataclass
class SegmentPlan:
    num_rows: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    block_m: int
    block_n: int
    num_programs: int
    prog_item: torch.Tensor  # [P] int32: item of each program
    prog_m0: torch.Tensor  # [P] int32: first query vector of the program's tile, within its item
    prog_n0: torch.Tensor  # [P] int32: key range [n0, n1) of the program, within its item's segment
    prog_n1: torch.Tensor  # [P] int32
    item_rows_start: torch.Tensor  # [I + 1] int32: CSR offsets into row_ids
    row_ids: torch.Tensor  # [Σ rows] int32
    item_blocks_start: torch.Tensor  # [I] int32: offset of each item's blocks in block_ids
    block_ids: torch.Tensor  # [Σ blocks] int32
    partial_pos: torch.Tensor  # [K] int64: valid (program, head, m) positions in the partial buffers
    partial_out: torch.Tensor  # [K] int64: the (row * h + head) each of them belongs to


def plan_segments(
    items: Sequence[SegmentItem],
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    device: torch.device | str,
    block_m: int = 16,
    block_n: int = 64,
    target_programs: int = 264,
    min_split: int = 256,
) -> SegmentPlan:
    """Tables for one step. Every row's items must cover its keys exactly once between them."""
    h, g = num_heads, num_kv_heads
    if h % g:
        raise ValueError(f"num_heads ({h}) must be a multiple of num_kv_heads ({g})")
    gq = h // g
    if not items:
        raise ValueError("plan_segments needs at least one item")
    tiles = []
    for it in items:
        if it.num_tokens < 1 or not it.rows:
            raise ValueError("every item needs at least one row and one token")
        if it.num_tokens > len(it.blocks) * block_size:
            raise ValueError(f"item of {it.num_tokens} tokens has only {len(it.blocks)} blocks of {block_size}")
        tiles.append(-(-len(it.rows) * gq // block_m))
    # flash-decoding: split keys when there are too few (item, m-tile, head) programs to fill the device
    base = sum(tiles) * g
    longest = max(it.num_tokens for it in items)
    split = longest
    if base < target_programs:
        want = -(-target_programs // base)
        split = max(min_split, -(-longest // want))
    split = -(-split // block_n) * block_n
    prog_item, prog_m0, prog_n0, prog_n1 = [], [], [], []
    pos, out = [], []
    rows_start, row_ids, blocks_start, block_ids = [0], [], [], []
    for i, it in enumerate(items):
        blocks_start.append(len(block_ids))
        block_ids.extend(int(b) for b in it.blocks)
        row_ids.extend(int(r) for r in it.rows)
        rows_start.append(len(row_ids))
        m_total = len(it.rows) * gq
        for t in range(tiles[i]):
            for n0 in range(0, it.num_tokens, split):
                p = len(prog_item)
                prog_item.append(i)
                prog_m0.append(t * block_m)
                prog_n0.append(n0)
                prog_n1.append(min(n0 + split, it.num_tokens))
                for j in range(g):
                    for mm in range(block_m):
                        m = t * block_m + mm
                        if m < m_total:
                            row, head = it.rows[m // gq], j * gq + m % gq
                            pos.append((p * g + j) * block_m + mm)
                            out.append(row * h + head)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    def i64(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    return SegmentPlan(
        num_rows=num_rows, num_heads=h, num_kv_heads=g, block_size=block_size, block_m=block_m, block_n=block_n,
        num_programs=len(prog_item), prog_item=i32(prog_item), prog_m0=i32(prog_m0), prog_n0=i32(prog_n0),
        prog_n1=i32(prog_n1), item_rows_start=i32(rows_start), row_ids=i32(row_ids),
        item_blocks_start=i32(blocks_start), block_ids=i32(block_ids), partial_pos=i64(pos), partial_out=i64(out),
    )


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def segment_attention_kernel(
        Q, K, V, O_part, LSE_part,
        prog_item, prog_m0, prog_n0, prog_n1, item_rows_start, row_ids, item_blocks_start, block_ids,
        stride_qr, stride_qh, stride_kg, stride_ks, stride_vg, stride_vs,
        scale,
        G: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        p = tl.program_id(0)
        j = tl.program_id(1)  # KV head
        item = tl.load(prog_item + p)
        m0 = tl.load(prog_m0 + p)
        n0 = tl.load(prog_n0 + p)
        n1 = tl.load(prog_n1 + p)
        r0 = tl.load(item_rows_start + item)
        r1 = tl.load(item_rows_start + item + 1)
        b0 = tl.load(item_blocks_start + item)

        offs_mm = tl.arange(0, BLOCK_M)
        offs_m = m0 + offs_mm
        offs_d = tl.arange(0, D)
        m_mask = offs_m < (r1 - r0) * GQ
        row = tl.load(row_ids + r0 + offs_m // GQ, mask=m_mask, other=0)
        head = j * GQ + offs_m % GQ
        q = tl.load(Q + row[:, None] * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n in range(n0, n1, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n1
            blk = tl.load(block_ids + b0 + offs_n // BS, mask=n_mask, other=0)
            slot = blk.to(tl.int64) * BS + offs_n % BS
            k = tl.load(K + j * stride_kg + slot[:, None] * stride_ks + offs_d[None, :],
                        mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(V + j * stride_vg + slot[:, None] * stride_vs + offs_d[None, :],
                        mask=n_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m_i = m_new
        o = acc / l_i[:, None]
        lse = m_i + tl.log(l_i)
        base = (p * G + j) * BLOCK_M
        tl.store(O_part + (base + offs_mm)[:, None] * D + offs_d[None, :], o)
        tl.store(LSE_part + base + offs_mm, lse)

    return segment_attention_kernel


def segment_attention(
    q: torch.Tensor,  # [R, h, D] one query token per decode row
    k_cache: torch.Tensor,  # [g, num_slots, D]
    v_cache: torch.Tensor,  # [g, num_slots, D]
    plan: SegmentPlan,
    scale: float | None = None,
    out: torch.Tensor | None = None,  # [R, h, D], written in full
    out_lse: torch.Tensor | None = None,  # [R, h] float32, written in full
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every decode row over the union of its items' keys: (o [R, h, D], lse [R, h])."""
    R, h, D = q.shape
    g = k_cache.shape[0]
    if (R, h, g) != (plan.num_rows, plan.num_heads, plan.num_kv_heads):
        raise ValueError(f"q {tuple(q.shape)} / cache heads {g} do not match the plan")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 16")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the K/V cache's last dimension must be contiguous")
    P = plan.num_programs
    o_part = torch.empty(P * g * plan.block_m, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(P * g * plan.block_m, dtype=torch.float32, device=q.device)
    _kernel()[(P, g)](
        q, k_cache, v_cache, o_part, lse_part,
        plan.prog_item, plan.prog_m0, plan.prog_n0, plan.prog_n1, plan.item_rows_start, plan.row_ids,
        plan.item_blocks_start, plan.block_ids,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        scale,
        G=g, GQ=h // g, D=D, BS=plan.block_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
    )
    return merge_partials_into(o_part, lse_part, plan, q.dtype, out, out_lse)


def merge_partials_into(
    o_part: torch.Tensor,  # [P·g·BLOCK_M, D] float32
    lse_part: torch.Tensor,  # [P·g·BLOCK_M] float32
    plan: SegmentPlan,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE merge of every (row, head)'s partials; fixed-size index ops (no host sync)."""
    R, h = plan.num_rows, plan.num_heads
    D = o_part.shape[-1]
    idx = plan.partial_out
    lse = lse_part.index_select(0, plan.partial_pos)
    o = o_part.index_select(0, plan.partial_pos)
    mx = torch.full((R * h,), float("-inf"), dtype=torch.float32, device=o.device)
    mx = mx.scatter_reduce(0, idx, lse, "amax")
    w = torch.exp(lse - mx.index_select(0, idx))
    den = torch.zeros(R * h, dtype=torch.float32, device=o.device).index_add_(0, idx, w)
    num = torch.zeros(R * h, D, dtype=torch.float32, device=o.device).index_add_(0, idx, o * w[:, None])
    res = (num / den[:, None]).view(R, h, D)
    res_lse = (mx + torch.log(den)).view(R, h)
    if out is None:
        out = res.to(dtype)
    else:
        out.copy_(res)
    if out_lse is None:
        out_lse = res_lse
    else:
        out_lse.copy_(res_lse)
    return out, out_lse
