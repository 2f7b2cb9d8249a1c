"""Sampling math against straightforward references; counter-based seeds."""

import math
import zlib

import pytest
import torch

from forklm.errors import InvalidArgumentError
from forklm.sampling.params import SamplingParams
from forklm.sampling.sampler import draw_inverse_cdf, filtered_candidates, model_logprobs, sample_tokens
import random

from forklm.sampling.seeds import counter_uniform, counter_uniforms


def reference_distribution(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The obvious way: temperature, keep top-k, renormalize, keep the nucleus, renormalize."""
    probs = torch.softmax(logits_row.double() / temperature, dim=0)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = order[:top_k] if top_k else order
    mass = sum(probs[i].item() for i in keep)
    kept, acc = [], 0.0
    for i in keep:
        if acc >= top_p * mass:
            break
        kept.append(i)
        acc += probs[i].item()
    out = torch.zeros_like(probs)
    for i in kept:
        out[i] = probs[i]
    return out / out.sum()


def implied_distribution(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    weights, ids = filtered_candidates(logits, temperature, top_k, top_p)
    dist = torch.zeros(logits.shape, dtype=torch.float64)
    if ids is None:
        dist += weights.double()
    else:
        dist.scatter_add_(1, ids, weights.double())
    return dist / dist.sum(-1, keepdim=True)


@pytest.mark.parametrize("V", [50, 3000])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 10, 1.0), (0.8, 40, 0.5), (2.0, 0, 0.999)])
def test_filtered_distribution_matches_reference(V, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(V + top_k)
    logits = torch.randn(3, V, generator=gen) * 3
    got = implied_distribution(logits, temperature, top_k, top_p)
    for r in range(3):
        ref = reference_distribution(logits[r], temperature, top_k, top_p)
        assert torch.allclose(got[r], ref, atol=1e-6), (r, (got[r] - ref).abs().max())


def test_wide_nucleus_is_selected_exactly():
    # Near-uniform logits: the 0.99 nucleus needs almost all 5000 tokens (wider than the probes).
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(0)) * 0.01
    got = implied_distribution(logits, 1.0, 0, 0.99)
    ref = reference_distribution(logits[0], 1.0, 0, 0.99)
    assert (got[0] > 0).sum() > 1024
    assert torch.allclose(got[0], ref, atol=1e-9)


@pytest.mark.parametrize("C", [7, 256, 1000, 49152])
def test_inverse_cdf_is_exact_at_block_edges(C):
    gen = torch.Generator().manual_seed(C)
    w = torch.rand(4, C, generator=gen)
    w[w < 0.5] = 0.0  # many zero weights: never drawn
    cum = torch.cumsum(w.double(), dim=-1)
    for u in [0.0, 0.1234, 0.5, 0.999999]:
        idx = draw_inverse_cdf(w, torch.full((4,), u, dtype=torch.float64))
        for r in range(4):
            expect = int(torch.searchsorted(cum[r], u * cum[r, -1], right=True))
            assert w[r, idx[r]] > 0
            assert abs(int(idx[r]) - expect) <= 1  # float32 block sums may shift a hair at an edge
            assert int(idx[r]) == expect or abs(cum[r, expect - 1] / cum[r, -1] - u) < 1e-5


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits[0] / 0.9, 0)
    N = 20000
    counts = torch.zeros(5)
    us = torch.tensor([counter_uniform(11, 0, t) for t in range(N)], dtype=torch.float64)
    toks = sample_tokens(logits.expand(N, 5), 0.9, 0, 1.0, us)
    counts = torch.bincount(toks, minlength=5).float() / N
    assert (counts - probs).abs().max() < 0.015  # ~4 sigma at N=20000


def test_greedy_and_logprobs():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(2))
    toks = sample_tokens(logits, 0.0, 0, 1.0, torch.zeros(5, dtype=torch.float64))
    assert torch.equal(toks, logits.argmax(-1))
    lp = model_logprobs(logits, toks)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0])


def test_counter_uniform_depends_only_on_its_triple():
    a = counter_uniform(5, 3, 17)
    assert a == counter_uniform(5, 3, 17)
    assert 0 <= a < 1
    others = {counter_uniform(5, 3, 18), counter_uniform(5, 4, 17), counter_uniform(6, 3, 17)}
    assert a not in others and len(others) == 3
    us = [counter_uniform(1, i, 0) for i in range(4000)]
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    assert math.isclose(sorted(us)[2000], 0.5, abs_tol=0.03)


def test_batched_uniforms_equal_the_scalar_function_bit_for_bit():
    rng = random.Random(7)
    seeds = [0, 1, (1 << 64) - 1, 1 << 63, -5] + [rng.getrandbits(64) for _ in range(300)]
    idx = [rng.randrange(0, 1 << 20) for _ in seeds]
    steps = [rng.randrange(0, 1 << 17) for _ in seeds]
    got = counter_uniforms(seeds, idx, steps)
    assert got.dtype == torch.float64 and got.shape == (len(seeds),)
    assert got.tolist() == [counter_uniform(s, i, t) for s, i, t in zip(seeds, idx, steps)]


@pytest.mark.parametrize(
    "kwargs,name",
    [({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
     ({"seed": -3}, "seed"), ({"stop": [""]}, "stop"), ({"attention": "fast"}, "attention"),
     ({"n": 2.5}, "n"), ({"temperature": float("nan")}, "temperature")],
)
def test_bad_sampling_params_name_the_argument(kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**kwargs)


def test_top_p_draw_does_not_depend_on_the_batch():
    """A peaked row drawn alone or next to near-uniform rows (which need a full sort) gets the
    same token for every uniform: each row settles at its own nucleus width."""
    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(1, 5000, generator=gen) * 6
    flat = torch.randn(3, 5000, generator=gen) * 0.01
    for i in range(50):
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        alone = sample_tokens(peaked, 0.9, 0, 0.9, u[:1])
        batched = sample_tokens(torch.cat([flat[:2], peaked, flat[2:]]), 0.9, 0, 0.9, u[[1, 2, 0, 3]])
        assert batched[2] == alone[0]
    from forklm.sampling.sampler import nucleus_groups

    probs = torch.softmax(torch.cat([flat[:2], peaked, flat[2:]]) / 0.9, dim=-1)
    widths = {int(r): (ids.shape[1] if ids is not None else "dense") for rows, _, ids in nucleus_groups(probs, 0.9) for r in rows}
    assert widths[2] == 64 and widths[0] == widths[1] == widths[3] == "dense"


def sorted_nucleus(row: torch.Tensor, top_p: float) -> tuple[set[int], float]:
    """Reference: sort descending (float64 sums), keep tokens whose preceding mass is < top_p.
    Also returns how close the boundary's cumulative mass came to top_p: the select sums
    float32 buckets (~1e-6 error on a row of 7k tokens), which can flip a token that close."""
    vals, ids = torch.sort(row.double(), descending=True)
    before = torch.cumsum(vals, 0) - vals
    kept = before < top_p
    return set(ids[kept].tolist()), float((before - top_p).abs().min())


@pytest.mark.parametrize("case", ["flat", "peaked", "ties", "near-one", "spiky", "zeros"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_nucleus_mask_equals_sorting(case, top_p):
    from forklm.sampling.sampler import nucleus_mask

    gen = torch.Generator().manual_seed(zlib.crc32(f"{case} {top_p}".encode()))
    V = 7001
    scale = {"flat": 0.3, "peaked": 4.0, "ties": 1.0, "near-one": 0.05, "spiky": 1.0, "zeros": 2.0}[case]
    logits = torch.randn(6, V, generator=gen) * scale
    if case == "ties":  # many exactly equal probabilities, the boundary inside a tie
        logits = torch.round(logits * 2) / 2
    if case == "spiky":  # a few huge, the rest tiny
        logits[:, :5] += 12
    if case == "zeros":  # exact zeros (masked tokens) and denormal-sized probabilities
        logits[:, ::3] = float("-inf")
        logits[:, 1::7] -= 95
    probs = torch.softmax(logits, dim=-1)
    mask = nucleus_mask(probs, top_p)
    for r in range(6):
        ref, margin = sorted_nucleus(probs[r], top_p)
        got = set(torch.nonzero(mask[r])[:, 0].tolist())
        if case == "ties":
            # which of the equal tokens are kept is an order choice; the count and the rest are not
            assert len(got) == len(ref) or margin < 2e-5
            tau = probs[r][sorted(ref, key=lambda i: probs[r, i].item())[0]]
            assert {i for i in got if probs[r, i] != tau} == {i for i in ref if probs[r, i] != tau}
            continue
        if margin < 2e-5:  # float32 bucket sums round differently at the boundary: one token apart at most
            assert len(got ^ ref) <= 1, (r, len(got), len(ref))
        else:
            assert got == ref, (r, len(got), len(ref), len(got ^ ref))
        # and the set is a top set: everything kept is at least as likely as everything left out
        if got and len(got) < V:
            left = probs[r][~mask[r]]
            assert probs[r][mask[r]].min() >= left.max()


def test_wide_nucleus_draw_is_the_inverse_cdf_of_the_reference():
    """Rows past the probes draw from the dense nucleus in vocabulary order: each uniform gives
    the token the reference distribution's inverse CDF gives."""
    gen = torch.Generator().manual_seed(9)
    V, N = 2000, 300
    logits = torch.randn(1, V, generator=gen) * 0.8
    ref = reference_distribution(logits[0], 1.0, 0, 0.9)
    assert (ref > 0).sum() > 1024  # past both probes
    cum = torch.cumsum(ref, 0)
    us = torch.rand(N, generator=gen, dtype=torch.float64)
    toks = sample_tokens(logits.expand(N, V), 1.0, 0, 0.9, us)
    expect = torch.searchsorted(cum, us * cum[-1], right=True)
    assert bool((ref[toks] > 0).all())  # never outside the nucleus
    near_edge = (cum[expect.clamp_max(V - 1)] / cum[-1] - us).abs() < 1e-6
    assert bool(((toks == expect) | near_edge).all())


def test_broken_rows_do_not_crash_sampling():
    """NaN or all -inf logits (a model gone wrong, an fp16 overflow) still give a token id in
    range for every sampler path instead of an exception that would stop the engine."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 0.1
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, :10] = float("nan")
    u = torch.rand(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for temperature, top_k, top_p in [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.0, 40, 0.9), (1.0, 0, 1.0), (0.0, 0, 1.0)]:
        toks = sample_tokens(logits, temperature, top_k, top_p, u)
        assert toks.shape == (4,) and bool(((toks >= 0) & (toks < 3000)).all())
