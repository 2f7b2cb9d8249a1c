"""Sampling math as small pure functions over a batch of rows that share their parameters.

Order (as in Hugging Face's logits processors): temperature, then top-k, then top-p, then one
inverse-CDF draw per row from a counter-based uniform (see seeds.py). A full sort of the
vocabulary is slow on a CPU (~125 ms for 64 × 49k), so top-p first looks for the nucleus among
the largest few probabilities and sorts the whole row only when the nucleus is wider; each row
settles at its own width, so a row's draw does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures below this draw greedily (dividing by them overflows float32)
_NUCLEUS_PROBES = (64, 1024)  # candidate widths tried before a full sort
_BLOCK = 256  # inverse-CDF block width (two-level search keeps float32 sums accurate)


def model_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own log-softmax of the chosen tokens (before temperature/top-k/top-p).

    logits [b, V] float32, tokens [b] -> [b] float32
    """
    return logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def filtered_candidates(
    logits: torch.Tensor,  # [b, V] float32
    temperature: float,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution to draw from, as (probs [b, C], ids [b, C] or None for the identity).

    Rows of probs are unnormalized weights: zero for excluded tokens. When ids is None, column
    j is token j. The draw does not depend on the order of candidates beyond the inverse CDF,
    which is taken in the order returned.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    V = probs.shape[-1]
    if top_k and top_k < V:
        probs, ids = torch.topk(probs, top_k, dim=-1)  # sorted descending
        if top_p < 1.0:
            probs = _nucleus_of_sorted(probs / probs.sum(-1, keepdim=True), top_p)
        return probs, ids
    if top_p >= 1.0:
        return probs, None
    dense = torch.zeros_like(probs)  # each row's nucleus as weights over the whole vocabulary
    for rows, weights, ids in nucleus_groups(probs, top_p):
        dense[rows] = dense[rows].scatter(1, ids, weights)
    return dense, None


def _nucleus_of_sorted(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes tokens outside the smallest prefix whose mass reaches top_p (rows sorted desc)."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
    return sorted_probs.masked_fill(before >= top_p, 0.0)


def nucleus_groups(probs: torch.Tensor, top_p: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Top-p over a full vocabulary as groups (rows, weights [r, C], ids [r, C]), sorted descending.

    Each row settles at the narrowest probe width (64, 1024, then a full sort) whose largest
    probabilities reach top_p, so its candidates, and hence its draw, never depend on the other
    rows of the batch (the sampler is batch-invariant).
    """
    b, V = probs.shape
    rows = torch.arange(b, device=probs.device)
    groups = []
    for k in _NUCLEUS_PROBES + (V,):
        sub = probs if rows.numel() == b else probs.index_select(0, rows)
        if k >= V:
            vals, ids = torch.sort(sub, dim=-1, descending=True)
            ok = torch.ones(rows.numel(), dtype=torch.bool, device=probs.device)
        else:
            vals, ids = torch.topk(sub, k, dim=-1)  # sorted descending
            ok = vals.sum(-1) >= top_p
        if bool(ok.all()):
            groups.append((rows, _nucleus_of_sorted(vals, top_p), ids))
            return groups
        if bool(ok.any()):
            groups.append((rows[ok], _nucleus_of_sorted(vals[ok], top_p), ids[ok]))
        rows = rows[~ok]
    return groups


def draw_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index j per row with P(j) = w_j / Σ w, from uniforms u [b] (float64) in [0, 1).

    Two levels: block sums choose a block of _BLOCK columns, then a cumulative sum inside it.
    """
    b, C = weights.shape
    w = weights.double() if C <= _BLOCK else weights
    if C <= _BLOCK:
        cum = torch.cumsum(w, dim=-1)
        target = (u * cum[:, -1]).unsqueeze(1)
        return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_max(C - 1)
    pad = (-C) % _BLOCK
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    blocks = w.view(b, -1, _BLOCK)
    block_cum = torch.cumsum(blocks.sum(-1).double(), dim=-1)  # [b, nb]
    target = u * block_cum[:, -1]
    blk = torch.searchsorted(block_cum, target.unsqueeze(1), right=True).squeeze(1)
    blk = blk.clamp_max(blocks.shape[1] - 1)
    # Skip empty trailing blocks a rounding edge might land on.
    before = torch.where(blk > 0, block_cum.gather(1, (blk - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    inner = blocks[torch.arange(b), blk].double()  # [b, _BLOCK]
    inner_cum = torch.cumsum(inner, dim=-1)
    rest = (target - before).clamp_min(0.0).unsqueeze(1)
    j = torch.searchsorted(inner_cum, rest, right=True).squeeze(1).clamp_max(_BLOCK - 1)
    # A rounding edge can point at a zero-weight slot: move to the last nonzero slot at or before it.
    nonzero = inner > 0
    idx = torch.arange(_BLOCK).expand(b, _BLOCK)
    last_nz = torch.where(nonzero & (idx <= j.unsqueeze(1)), idx, -1).max(dim=1).values
    j = torch.where(nonzero.gather(1, j.unsqueeze(1)).squeeze(1), j, last_nz.clamp_min(0))
    return blk * _BLOCK + j


def sample_tokens(
    logits: torch.Tensor,  # [b, V] float32
    temperature: float,
    top_k: int,
    top_p: float,
    u: torch.Tensor,  # [b] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [b] int64 token ids
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    if top_p < 1.0 and not (top_k and top_k < logits.shape[-1]):
        probs = torch.softmax(logits / temperature, dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for rows, weights, ids in nucleus_groups(probs, top_p):
            j = draw_inverse_cdf(weights, u[rows.cpu()])
            out[rows] = ids.gather(1, j.unsqueeze(1)).squeeze(1)
        return out
    weights, ids = filtered_candidates(logits, temperature, top_k, top_p)
    j = draw_inverse_cdf(weights, u)
    return j if ids is None else ids.gather(1, j.unsqueeze(1)).squeeze(1)
