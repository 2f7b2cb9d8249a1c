"""Attention for one forked request: prefill of the prompt, then decode steps of `b` samples.

Both classes implement the model's attention interface

    attend(layer, q [T, h, D], k [T, g, D], v [T, g, D]) -> [T, h, D]

storing the new keys/values in a `ForkedKVCache` and attending over what the cache holds.

Decode paths (`b` samples, one new token each, `p = h / g` query heads per KV head):
- "standard": what conventional engines do: every sample attends to its own full K/V, the
  prompt part expanded per sample, so the prompt's KV is read `b` times per step.
- "bifurcated": the prompt part is one product per KV head over all `b·p` query rows, reading
  the prompt's KV once per step; the decoded part per sample; merged exactly by log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from forklm.attention.segments import attend_segment, merge_partials
from forklm.reference.forked_kv import ForkedKVCache

DECODE_PATHS = ("standard", "bifurcated")


class PrefillAttention:
    """Causal attention over the prompt (optionally a chunk starting at `start`)."""

    def __init__(self, cache: ForkedKVCache, start: int = 0) -> None:
        self.cache = cache
        self.start = start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T, h, D = q.shape
        g = k.shape[1]
        s0, s1 = self.start, self.start + T
        ck, cv = self.cache.ctx_k[layer], self.cache.ctx_v[layer]
        ck[0, :, s0:s1] = k.transpose(0, 1)
        cv[0, :, s0:s1] = v.transpose(0, 1)
        keys = ck[:, :, :s1].repeat_interleave(h // g, dim=1)  # [1, h, s1, D]
        vals = cv[:, :, :s1].repeat_interleave(h // g, dim=1)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, T, D]
        if s0 == 0:
            o = F.scaled_dot_product_attention(qh, keys, vals, is_causal=True)
        else:
            rows = torch.arange(s0, s1, device=q.device).unsqueeze(1)
            cols = torch.arange(s1, device=q.device).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=cols <= rows)
        return o[0].transpose(0, 1)  # [T, h, D]


class DecodeAttention:
    """One decode step for the cache's live samples (row i of q is sample i's new token)."""

    def __init__(self, cache: ForkedKVCache, path: str) -> None:
        if path not in DECODE_PATHS:
            raise ValueError(f"attention path must be one of {DECODE_PATHS}, got {path!r}")
        self.cache = cache
        self.path = path

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, D = q.shape
        g = k.shape[1]
        p = h // g
        t = self.cache.own_len
        own_k, own_v = self.cache.own_k[layer], self.cache.own_v[layer]
        own_k[:, :, t] = k
        own_v[:, :, t] = v
        ctx_k, ctx_v = self.cache.ctx_k[layer], self.cache.ctx_v[layer]  # [1, g, m_c, D]
        q_grouped = q.view(b, g, p, D)  # query head j uses KV head j // p
        scale = 1.0 / math.sqrt(D)
        if self.path == "bifurcated":
            # One product per KV head: all b·p query rows against the prompt's K/V, read once.
            q_rows = q_grouped.transpose(0, 1).reshape(1, g, b * p, D)
            o_ctx, lse_ctx = attend_segment(q_rows, ctx_k, ctx_v, scale)
            o_ctx = o_ctx.view(g, b, p, D).transpose(0, 1)
            lse_ctx = lse_ctx.view(g, b, p).transpose(0, 1)
        else:
            m_c = ctx_k.shape[2]
            o_ctx, lse_ctx = attend_segment(
                q_grouped, ctx_k.expand(b, g, m_c, D), ctx_v.expand(b, g, m_c, D), scale
            )
        o_own, lse_own = attend_segment(q_grouped, own_k[:, :, : t + 1], own_v[:, :, : t + 1], scale)
        o, _ = merge_partials(o_ctx, lse_ctx, o_own, lse_own)
        return o.reshape(b, h, D)
