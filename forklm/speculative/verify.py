"""Verification of drafts as pure functions (no engine state).

Words (as in vLLM's rejection sampler): a *draft* is the k tokens a drafter proposed for one
sequence; *accepted* tokens are its leading tokens the target keeps; the *recovered* token
replaces the first rejected one; the *bonus* token follows a fully accepted draft. Either way a
sequence emits accepted + 1 tokens per step (ragged across the batch).

Point-mass drafters (the n-gram drafter, a greedy draft model) propose one token per position.
For them the target draws its own token at each position exactly as non-speculative sampling
would (same logits row, temperature, top-k, top-p, and the same counter-based uniform of
(seed, sample, position)), and a draft token is accepted while it equals the drawn one. The
emitted tokens are then the drawn ones, so the output is *identical* to non-speculative
sampling with the same seed, whatever the drafter proposed (`accepted_prefix`).

A drafter that samples from a distribution q needs modified rejection sampling
(`rejection_sample`): accept draft x with probability min(1, p(x) / q(x)); at the first
rejection draw from normalize(max(0, p - q)); after k acceptances draw the bonus from p.
Exact in distribution (Leviathan et al. 2023, Chen et al. 2023), not token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forklm.sampling.sampler import GREEDY_BELOW, filtered_candidates


def accepted_prefix(draft: Sequence[int], drawn: Sequence[int]) -> int:
    """How many leading draft tokens equal the target's drawn tokens (drawn[j] is the target's
    token at the draft's position j; drawn has one more entry: the bonus position)."""
    a = 0
    for d, y in zip(draft, drawn):
        if d != y:
            break
        a += 1
    return a


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for drafted tokens x (q(x) > 0: the drafter drew x)."""
    return torch.clamp(p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), max=1.0)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise draw of an index with probability weights / sum (weights [B, V] >= 0, u [B] in [0, 1))."""
    cum = torch.cumsum(weights.double(), dim=-1)
    target = (u.double() * cum[:, -1]).unsqueeze(1)
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_max(weights.shape[-1] - 1)


def rejection_sample(
    p: torch.Tensor,  # [B, k + 1, V] target probabilities (after temperature/top-k/top-p) at each draft position and the bonus
    q: torch.Tensor,  # [B, k, V] draft probabilities the draft tokens were drawn from
    draft: torch.Tensor,  # [B, k] int64 draft tokens
    u_accept: torch.Tensor,  # [B, k] uniforms in [0, 1)
    u_draw: torch.Tensor,  # [B] uniforms in [0, 1) for the recovered or bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Modified rejection sampling for a batch of drafts of equal length k.

    Returns (accepted [B] int64 in 0..k, next_token [B] int64): row b emits draft[b, :accepted[b]]
    then next_token[b] (recovered from max(0, p - q) at the first rejection, else the bonus from
    p[:, k])."""
    B, k = draft.shape
    idx = draft.unsqueeze(-1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, idx).squeeze(-1)
    ok = u_accept < acceptance_probability(p_x, q_x)  # [B, k]
    # accepted = leading run of True
    accepted = torch.cumprod(ok.long(), dim=-1).sum(-1) if k else torch.zeros(B, dtype=torch.long)
    rows = torch.arange(B)
    at = accepted.clamp_max(max(k - 1, 0))
    p_at = p[rows, accepted]  # [B, V]: p at the first rejected position, or the bonus position
    if k:
        residual = (p[rows, at] - q[rows, at]).clamp_min(0.0)
        # a row whose residual is all zero has p == q there and never rejects; guard the division
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
        weights = torch.where((accepted < k).unsqueeze(-1), residual, p_at)
    else:
        weights = p_at
    return accepted, _inverse_cdf(weights, u_draw)


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution decoding draws from (temperature, top-k, top-p; a point mass on the argmax
    below `GREEDY_BELOW`): logits [b, V] float32 -> probabilities [b, V] float64 summing to 1."""
    if temperature < GREEDY_BELOW:
        out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
        return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    w, ids = filtered_candidates(logits, temperature, top_k, top_p)
    w = w.double()
    if ids is not None:
        w = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device).scatter_(1, ids, w)
    return w / w.sum(-1, keepdim=True)
