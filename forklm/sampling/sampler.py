"""Sampling math as small pure functions over a batch of rows that share their parameters.

Order (as in Hugging Face's logits processors): temperature, then top-k, then top-p, then one
inverse-CDF draw per row from a counter-based uniform (see seeds.py). The rule is
`sample_weights_reference` (ties in the order broken by token id; the draw walks the kept tokens
in token-id order). On CPU tensors `sample_tokens` and `model_logprobs` run forklm's C++ sampler
(kernels/cpu_sampler.py: a few passes over each row, 4-6x faster than the operators below); elsewhere
`sample_tokens_torch` runs it in PyTorch operators: a full sort of the vocabulary is slow on a CPU
(~120 ms for 64 × 49k), so top-p first looks for the nucleus among the 64 largest probabilities
(one `topk`) and, for a row whose nucleus is wider, selects it without sorting: a radix select
over the float32 bit patterns (`nucleus_mask`), 8x faster than the sort on flat rows. Each row
settles on its own, so a row's draw does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

GREEDY_BELOW = 1e-5  # temperatures below this draw greedily (dividing by them overflows float32)
_NUCLEUS_PROBES = (64,)  # candidate widths tried (one topk) before the radix select
# Radix select digits over a float32's bit pattern (shift, bins): the high 13 bits (sign,
# exponent, 4 mantissa bits; probabilities <= 1.0 have at most 0x7F0 there), then 9, then the
# last 10. Later levels' bins are powers of two (the digit is a mask of bins - 1).
_RADIX_LEVELS = ((19, 0x7F0 + 1), (10, 512), (0, 1024))
_BLOCK = 256  # inverse-CDF block width (two-level search keeps float32 sums accurate)


def _cpu_sampler(logits: torch.Tensor):
    """forklm's C++ sampler (kernels/cpu_sampler.py) when it runs these logits, else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    from forklm.kernels import cpu_sampler

    return cpu_sampler if cpu_sampler.available() else None


def model_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own log-softmax of the chosen tokens (before temperature/top-k/top-p).

    logits [b, V] float32, tokens [b] -> [b] float32
    """
    kernel = _cpu_sampler(logits)
    if kernel is not None:
        return kernel.token_logprobs(logits, tokens.to(torch.long))
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
        dense[rows] = weights if ids is None else dense[rows].scatter(1, ids, weights)
    return dense, None


def _nucleus_of_sorted(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes tokens outside the smallest prefix whose mass reaches top_p (rows sorted desc)."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
    return sorted_probs.masked_fill(before >= top_p, 0.0)


def nucleus_groups(
    probs: torch.Tensor, top_p: float
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Top-p over a full vocabulary as groups (rows, weights [r, C], ids [r, C] or None).

    Each row settles at the narrowest probe width (64: weights sorted descending, ids their
    tokens) whose largest probabilities reach top_p; rows with a wider nucleus come
    back dense (weights [r, V] in vocabulary order, zero outside the nucleus, ids None). A row's
    candidates, and hence its draw, never depend on the other rows (the sampler is
    batch-invariant).
    """
    b, V = probs.shape
    rows = torch.arange(b, device=probs.device)
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for k in _NUCLEUS_PROBES:
        if k >= V:
            break
        sub = probs if rows.numel() == b else probs.index_select(0, rows)
        vals, ids = torch.topk(sub, k, dim=-1)  # sorted descending
        ok = vals.sum(-1) >= top_p
        if bool(ok.all()):
            groups.append((rows, _nucleus_of_sorted(vals, top_p), ids))
            return groups
        if bool(ok.any()):
            groups.append((rows[ok], _nucleus_of_sorted(vals[ok], top_p), ids[ok]))
        rows = rows[~ok]
    sub = probs if rows.numel() == b else probs.index_select(0, rows)
    groups.append((rows, sub * nucleus_mask(sub, top_p), None))
    return groups


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p nucleus of each row as a mask, without sorting: [r, V] float32 >= 0 -> bool [r, V].

    Same set as sorting descending and keeping each token whose preceding mass is < top_p (up to
    float32 rounding of the sums, as with a float32 cumsum over the sorted row).
    Non-negative float32s order as their int32 bit patterns, so a radix select finds the
    boundary: at each level, the mass per digit value of the tokens still undecided picks the
    digit where the running mass crosses top_p; tokens with a larger digit are in, smaller are
    out, equal ones go to the next level (only a few: after the first level, one bucket of
    relative width 1/16 per row). Tokens left after the last level share one value; the first
    ones by token id are kept until the mass reaches top_p (a sort breaks such ties in some
    order too).
    """
    r, V = probs.shape
    dev = probs.device
    probs = probs.float().contiguous()
    bits = probs.view(torch.int32)
    # Level 1 over the whole rows. Bucket masses are float32 sums (as the float32 cumsum over a
    # sorted row that transformers' top-p uses; float64 here cost 2x the time of the whole
    # select), running totals float64.
    shift, bins = _RADIX_LEVELS[0]
    digit = (bits >> shift).long().clamp_(0, bins - 1)  # [r, V]; clamped: NaN rows (a broken model) must not crash
    mass = torch.zeros(r, bins, dtype=torch.float32, device=dev).scatter_add_(1, digit, probs).double()
    above = torch.zeros(r, dtype=torch.float64, device=dev)  # mass of tokens kept so far
    crossing, above = _crossing_digit(mass, above, top_p)
    keep = digit > crossing.unsqueeze(1)
    # The rest on the few undecided tokens, as a flat list (row, column).
    row, col = torch.nonzero(digit == crossing.unsqueeze(1), as_tuple=True)
    vals, vbits = probs[row, col].double(), bits[row, col]
    for shift, bins in _RADIX_LEVELS[1:]:
        d = ((vbits >> shift) & (bins - 1)).long()
        mass = torch.zeros(r * bins, dtype=torch.float64, device=dev).index_add_(0, row * bins + d, vals)
        crossing, above = _crossing_digit(mass.view(r, bins), above, top_p)
        c = crossing[row]
        keep[row[d > c], col[d > c]] = True
        still = d == c
        row, col, vals, vbits = row[still], col[still], vals[still], vbits[still]
    # Ties: every token left in a row has the same value tau; keep the first m by token id,
    # m = how many steps of tau from the mass already kept it takes to reach top_p.
    m = torch.where(vals > 0, torch.ceil((top_p - above[row]) / vals.clamp_min(1e-300)), 0.0)
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]  # nonzero() lists each row's tokens together, by column
    start = torch.cummax(torch.where(first, torch.arange(row.numel(), device=dev), 0), 0).values
    rank = torch.arange(row.numel(), device=dev) - start + 1  # 1-based within the row
    sel = rank <= m
    keep[row[sel], col[sel]] = True
    return keep


def _crossing_digit(
    mass: torch.Tensor, above: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """mass [r, bins] float64 per digit value, above [r] mass already kept -> (crossing digit [r],
    mass kept once the digits above the crossing one are in [r])."""
    at_or_above = mass.flip(1).cumsum(1).flip(1)  # [r, bins]: mass of digits >= j
    # the largest j whose mass at or above still reaches top_p (rounding short of it: keep all)
    crossing = ((above.unsqueeze(1) + at_or_above) >= top_p).sum(1).sub(1).clamp_min(0)
    c = crossing.unsqueeze(1)
    return crossing, above + (at_or_above.gather(1, c) - mass.gather(1, c)).squeeze(1)


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
    inner = blocks[torch.arange(b, device=weights.device), blk].double()  # [b, _BLOCK]
    inner_cum = torch.cumsum(inner, dim=-1)
    rest = (target - before).clamp_min(0.0).unsqueeze(1)
    j = torch.searchsorted(inner_cum, rest, right=True).squeeze(1).clamp_max(_BLOCK - 1)
    # A rounding edge can point at a zero-weight slot: move to the last nonzero slot at or before it.
    nonzero = inner > 0
    idx = torch.arange(_BLOCK, device=weights.device).expand(b, _BLOCK)
    last_nz = torch.where(nonzero & (idx <= j.unsqueeze(1)), idx, -1).max(dim=1).values
    j = torch.where(nonzero.gather(1, j.unsqueeze(1)).squeeze(1), j, last_nz.clamp_min(0))
    return blk * _BLOCK + j


def _draw_in_id_order(weights: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw over candidates taken in token-id order (ids None: columns are tokens)."""
    if ids is None:
        return draw_inverse_cdf(weights, u)
    ids, order = ids.sort(dim=-1)
    j = draw_inverse_cdf(weights.gather(1, order), u)
    return ids.gather(1, j.unsqueeze(1)).squeeze(1)


def sample_tokens(
    logits: torch.Tensor,  # [b, V] float32
    temperature: float,
    top_k: int,
    top_p: float,
    u: torch.Tensor,  # [b] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [b] int64 token ids
    """One token per row by `sample_weights_reference`'s rule: on CPU tensors in one C++ call
    (kernels/cpu_sampler.py) where it is built, else `sample_tokens_torch`."""
    kernel = _cpu_sampler(logits) if temperature >= GREEDY_BELOW else None
    if kernel is not None:
        return kernel.sample_logits(logits, temperature, top_k, top_p, u.to(torch.float64))
    return sample_tokens_torch(logits, temperature, top_k, top_p, u)


def sample_tokens_torch(
    logits: torch.Tensor,  # [b, V] float32
    temperature: float,
    top_k: int,
    top_p: float,
    u: torch.Tensor,  # [b] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [b] int64 token ids
    """The same rule in PyTorch operators (any device), up to float32 rounding at the nucleus
    boundary (its masses are float32 sums, compared with top_p rather than top_p · Σ p)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    u = u.to(logits.device)  # the uniforms are made on the host
    if top_p < 1.0 and not (top_k and top_k < logits.shape[-1]):
        probs = torch.softmax(logits / temperature, dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for rows, weights, ids in nucleus_groups(probs, top_p):
            out[rows] = _draw_in_id_order(weights, ids, u[rows])
        return out
    weights, ids = filtered_candidates(logits, temperature, top_k, top_p)
    return _draw_in_id_order(weights, ids, u)


def sample_weights_reference(
    weights: torch.Tensor,  # [b, V] >= 0: probabilities, or any positive multiple of them
    top_k: int,
    top_p: float,
    u: torch.Tensor,  # [b] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [b] int64 token ids
    """The rule, the slow and obvious way (what the fast paths are held to). Per row, with float64
    sums: order the tokens by (weight descending, token id ascending); the candidates are the
    first top_k (0: all) with weight > 0; keep each candidate whose mass before it is below
    top_p · (the candidates' mass); draw the first kept token, in token-id order, at which the
    running mass exceeds u · (the kept mass). A row holding NaN or infinity, or no mass: token 0."""
    out = []
    for r in range(weights.shape[0]):
        vals, ids = torch.sort(weights[r].double().cpu(), descending=True, stable=True)  # ties: lower id first
        if not bool(torch.isfinite(vals).all()) or float(vals.sum()) <= 0:
            out.append(0)
            continue
        ids, vals = ids[vals > 0], vals[vals > 0]
        if top_k:
            ids, vals = ids[:top_k], vals[:top_k]
        if top_p < 1.0:
            keep = torch.cumsum(vals, 0) - vals < top_p * vals.sum()
            ids, vals = ids[keep], vals[keep]
        ids, order = ids.sort()
        cum = torch.cumsum(vals[order], 0)
        j = int(torch.searchsorted(cum, float(u[r]) * float(cum[-1]), right=True))
        out.append(int(ids[min(j, len(ids) - 1)]))
    return torch.tensor(out, dtype=torch.long, device=weights.device)


def sample_tokens_reference(
    logits: torch.Tensor,  # [b, V] float32
    temperature: float,
    top_k: int,
    top_p: float,
    u: torch.Tensor,  # [b] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [b] int64 token ids
    """`sample_weights_reference` on softmax(logits / temperature) (the argmax below GREEDY_BELOW)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    return sample_weights_reference(torch.softmax(logits.float() / temperature, dim=-1), top_k, top_p, u)
