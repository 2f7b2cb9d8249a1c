"""Attention for one engine step over the paged KV cache: decode rows and prefill chunks together.

The batch's flattened rows are `[decode rows (one token each) | chunk 0 | chunk 1 | ...]`.
It implements the model's interface `attend(layer, q [T, h, D], k [T, g, D], v [T, g, D])`.

Decode rows: each shared segment (see `shared_prefix.py`) is attended once for all its rows,
"bifurcated" (all `rows · p` query rows of a KV head in one product, the segment's K/V read
once) or "expanded" (each row reads the segment itself, as a conventional engine does),
chosen per segment by `attention/auto.py`'s measured rule. Each row's tail (its own blocks and
partial block, the current token included) is gathered into one padded batch. All partial
results are merged exactly by log-sum-exp.

Prefill chunks: the chunk's queries attend to the tokens before the chunk (paged, read in place)
and causally to the chunk itself, merged by log-sum-exp.

K/V of a run of consecutive slots is a view of the cache; a segment split into more than
`MAX_RUNS` runs (a fragmented pool) is gathered into one contiguous copy instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from forklm.attention.auto import choose_decode_path
from forklm.attention.segments import attend_segment, merge_partials
from forklm.attention.shared_prefix import shared_segments
from forklm.cache.paged_kv import PagedKVCache, slot_runs, slots_of

MAX_RUNS = 4

Runs = list[tuple[int, int]]  # [(first_slot, num_tokens), ...]


@dataclass
class SegmentRead:
    rows: torch.Tensor  # [s] decode rows reading the segment
    runs: Runs  # the segment's slots
    bifurcated: bool  # one product for all rows (True) or one read per row (False)


@dataclass
class PrefillChunk:
    row_start: int  # first batch row of the chunk
    num_tokens: int
    prefix_runs: Runs  # slots of the sequence's tokens before the chunk


@dataclass
class StepPlan:
    write_slots: torch.Tensor  # [T] slot of every batch row's new K/V
    num_decode: int = 0
    segments: list[SegmentRead] = field(default_factory=list)
    tail_slots: torch.Tensor | None = None  # [B, L] slots of each decode row's tail (padded)
    tail_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive mask (0 / -inf); None if no padding
    chunks: list[PrefillChunk] = field(default_factory=list)
    kernel_plan: object = None  # kernels.segment_attention.SegmentPlan when decode rows use the Triton kernel


def build_step_plan(
    decode_rows: list[tuple[list[int], int]],  # (block_table, num_computed): the token at num_computed is new
    chunks: list[tuple[list[int], int, int]],  # (block_table, s0, s1): tokens [s0, s1) are new
    block_size: int,
    shared_attention: str,  # "auto" | "bifurcated" | "standard"
    device: torch.device,
    mask_dtype: torch.dtype,
    decode_kernel: str = "torch",  # "torch" (attend_segment per segment) or "triton" (one fused kernel)
    num_heads: int = 0,  # needed by the Triton kernel's plan
    num_kv_heads: int = 0,
) -> StepPlan:
    """Where each new token's K/V goes and what each row attends to, for rows laid out as
    `[decode rows | chunk 0 | chunk 1 | ...]`."""
    bs = block_size
    slots = [table[t // bs] * bs + t % bs for table, t in decode_rows]
    plan_chunks = []
    row = len(decode_rows)
    for table, s0, s1 in chunks:
        slots.extend(slots_of(table, s0, s1, bs))
        plan_chunks.append(PrefillChunk(row, s1 - s0, slot_runs(table, 0, s0, bs)))
        row += s1 - s0
    plan = StepPlan(torch.tensor(slots, dtype=torch.long, device=device), len(decode_rows), chunks=plan_chunks)
    if not decode_rows:
        return plan
    full = [table[: t // bs] for table, t in decode_rows]
    segments, tail_start = shared_segments(full)
    if decode_kernel == "triton":
        from forklm.kernels.segment_attention import SegmentItem, plan_segments

        items = [SegmentItem(seg.rows, seg.blocks, len(seg.blocks) * bs) for seg in segments]
        for r, (table, t) in enumerate(decode_rows):  # each row's tail: its own blocks, current token included
            items.append(SegmentItem([r], table[tail_start[r] : t // bs + 1], t + 1 - tail_start[r] * bs))
        plan.kernel_plan = plan_segments(items, len(decode_rows), num_heads, num_kv_heads, bs, device)
        plan.segments = [SegmentRead(torch.tensor(seg.rows, device=device), [], True) for seg in segments]
        return plan
    for seg in segments:
        tokens = len(seg.blocks) * bs
        if shared_attention == "auto":
            bif = choose_decode_path(device.type, len(seg.rows), tokens, 0) == "bifurcated"
        else:
            bif = shared_attention == "bifurcated"
        runs = slot_runs(seg.blocks, 0, tokens, bs)
        plan.segments.append(SegmentRead(torch.tensor(seg.rows, dtype=torch.long, device=device), runs, bif))
    tails = [slots_of(table, tail_start[r] * bs, t + 1, bs) for r, (table, t) in enumerate(decode_rows)]
    lens = [len(t) for t in tails]
    L = max(lens)
    plan.tail_slots = torch.tensor([t + [t[0]] * (L - len(t)) for t in tails], dtype=torch.long, device=device)
    if min(lens) < L:
        valid = torch.arange(L, device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        mask = torch.zeros(len(tails), L, dtype=mask_dtype, device=device).masked_fill(~valid, float("-inf"))
        plan.tail_mask = mask.view(len(tails), 1, 1, L)
    return plan


class PagedAttention:
    def __init__(self, kv: PagedKVCache, plan: StepPlan) -> None:
        self.kv = kv
        self.plan = plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        T, h, D = q.shape
        g = k.shape[1]
        scale = 1.0 / math.sqrt(D)
        self.kv.write(layer, plan.write_slots, k, v)
        parts = []
        B = plan.num_decode
        if B:
            parts.append(self._decode(layer, q[:B], g, scale))
        for ch in plan.chunks:
            r0, r1 = ch.row_start, ch.row_start + ch.num_tokens
            parts.append(self._prefill(layer, q[r0:r1], k[r0:r1], v[r0:r1], ch.prefix_runs, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # ------------------------------------------------------------------ decode rows
    def _decode(self, layer: int, q: torch.Tensor, g: int, scale: float) -> torch.Tensor:
        plan = self.plan
        B, h, D = q.shape
        p = h // g
        if plan.kernel_plan is not None:  # every segment and tail in one kernel, merged exactly
            from forklm.kernels.segment_attention import segment_attention

            o, _ = segment_attention(q, self.kv.k[layer], self.kv.v[layer], plan.kernel_plan, scale)
            return o
        # Tails first: [B, L] slots gathered into [B, g, L, D] (one copy of the rows' own tokens).
        L = plan.tail_slots.shape[1]
        flat = plan.tail_slots.reshape(-1)
        kt = self.kv.k[layer].index_select(1, flat).view(g, B, L, D).transpose(0, 1)
        vt = self.kv.v[layer].index_select(1, flat).view(g, B, L, D).transpose(0, 1)
        o_t, lse_t = attend_segment(q.view(B, g, p, D), kt, vt, scale, attn_mask=plan.tail_mask)
        if not plan.segments:
            return o_t.reshape(B, h, D)
        o = o_t.reshape(B, h, D).float()
        lse = lse_t.reshape(B, h)
        # Then each shared segment, merged into its rows' running (o, lse) by log-sum-exp.
        for seg in plan.segments:
            everyone = seg.rows.numel() == B  # rows are sorted and distinct: all of them, in order
            qs = q if everyone else q.index_select(0, seg.rows)  # [s, h, D]
            s = qs.shape[0]
            for ks, vs in self._segment_kv(layer, seg.runs):  # [1, g, S, D] each
                if seg.bifurcated:
                    q_rows = qs.view(s, g, p, D).transpose(0, 1).reshape(1, g, s * p, D)
                    o_s, lse_s = attend_segment(q_rows, ks, vs, scale)
                    o_s = o_s.view(g, s, p, D).transpose(0, 1).reshape(s, h, D)
                    lse_s = lse_s.view(g, s, p).transpose(0, 1).reshape(s, h)
                else:
                    S = ks.shape[2]
                    o_s, lse_s = attend_segment(qs.view(s, g, p, D), ks.expand(s, g, S, D), vs.expand(s, g, S, D), scale)
                    o_s, lse_s = o_s.reshape(s, h, D), lse_s.reshape(s, h)
                if everyone:
                    o, lse = merge_partials(o, lse, o_s, lse_s)
                else:
                    o_m, lse_m = merge_partials(o.index_select(0, seg.rows), lse.index_select(0, seg.rows), o_s, lse_s)
                    o.index_copy_(0, seg.rows, o_m)
                    lse.index_copy_(0, seg.rows, lse_m)
        return o.to(q.dtype)

    def _segment_kv(self, layer: int, runs: Runs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        K, V = self.kv.k[layer], self.kv.v[layer]  # [g, slots, D]
        if len(runs) <= MAX_RUNS:
            return [(K[:, s : s + n].unsqueeze(0), V[:, s : s + n].unsqueeze(0)) for s, n in runs]
        idx = torch.cat([torch.arange(s, s + n, device=K.device) for s, n in runs])
        return [(K.index_select(1, idx).unsqueeze(0), V.index_select(1, idx).unsqueeze(0))]

    # ------------------------------------------------------------------ prefill chunks
    def _prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: Runs, scale: float
    ) -> torch.Tensor:
        T, h, D = q.shape
        g = k.shape[1]
        p = h // g
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, T, D]
        kh = k.transpose(0, 1).repeat_interleave(p, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(p, dim=0).unsqueeze(0)
        o, lse = attend_segment(qh, kh, vh, scale, causal=True)  # [1, h, T, D], [1, h, T]
        o = o.float()  # merged in float32, rounded once at the end
        if prefix:
            # All T·p query rows of a KV head against the earlier tokens, read in place.
            q_rows = q.view(T, g, p, D).permute(1, 0, 2, 3).reshape(1, g, T * p, D)
            for ks, vs in self._segment_kv(layer, prefix):
                o_p, lse_p = attend_segment(q_rows, ks, vs, scale)
                o_p = o_p.view(g, T, p, D).permute(0, 2, 1, 3).reshape(1, h, T, D)
                lse_p = lse_p.view(g, T, p).permute(0, 2, 1).reshape(1, h, T)
                o, lse = merge_partials(o, lse, o_p, lse_p)
        return o[0].transpose(0, 1).to(q.dtype)  # [T, h, D]
