"""Attention over KV segments, with exact log-sum-exp merging.

A sequence's KV is a list of segments: shared ones (the prompt, read once for every sample that
shares it) and its own (decoded tokens). Each segment yields a partial output and its
log-sum-exp; `merge_partials` combines them exactly (docs/design.md, "Attention over segments"):

    lse = log Σ_s exp(lse_s),   o = Σ_s exp(lse_s − lse) · o_s

Shapes use B (batch of independent problems), G (KV heads), M (query rows per KV head),
S (keys in the segment), D (head dim).
"""

from __future__ import annotations

import math

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_segment(
    q: torch.Tensor,  # [B, G, M, D]
    k: torch.Tensor,  # [B, G, S, D]  (B may be a stride-0 expansion)
    v: torch.Tensor,  # [B, G, S, D]
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,  # additive, broadcastable to [B, G, M, S]
    causal: bool = False,  # query row i sees keys 0..i (M == S)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query row over the segment (all of it unless masked or causal).

    Returns (o [B, G, M, D] in q's dtype, lse [B, G, M] float32, natural log).
    On CPU this is PyTorch's fused flash kernel, which never materializes the scores and
    returns the log-sum-exp; elsewhere a plain matmul/softmax fallback.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        o, lse = _CPU_FLASH(q, k, v, is_causal=causal, attn_mask=attn_mask, scale=scale)
        return o, lse.float()
    return attend_segment_matmul(q, k, v, scale, attn_mask, causal)


def attend_segment_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback with materialized scores (float32 softmax): [B,G,M,D] x [B,G,S,D] -> (o, lse)."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, G, M, S]
    if attn_mask is not None:
        s = s + attn_mask.float()
    if causal:
        M, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p.to(v.dtype), v)
    return o, lse


def merge_partials(
    o_a: torch.Tensor,  # [..., M, D]
    lse_a: torch.Tensor,  # [..., M] float32
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets.

    b's weight exp(lse_b - lse) is sigmoid(lse_b - lse_a), so o = lerp(o_a, o_b, weight): 8
    operators instead of 13 (a decode step merges once or twice per layer). A segment with no
    mass (lse -inf) gets weight 0 and leaves the other's output exact.
    """
    w_b = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    o = torch.lerp(o_a.float(), o_b.float(), w_b)
    return o.to(o_a.dtype), torch.logaddexp(lse_a, lse_b)


def merge_partials_reference(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                             lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge as written in docs/design.md (the test oracle of `merge_partials`)."""
    lse = torch.logaddexp(lse_a, lse_b)
    o = o_a.float() * torch.exp(lse_a - lse).unsqueeze(-1) + o_b.float() * torch.exp(lse_b - lse).unsqueeze(-1)
    return o.to(o_a.dtype), lse
