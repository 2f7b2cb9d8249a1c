"""Speculative sampling's pure parts: the n-gram index, BASS Algorithm 1, the cost rule, the
point-mass acceptance, modified rejection sampling (distribution, chi-squared), the config."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_llama

from forklm.errors import InvalidArgumentError
from forklm.speculative import verify
from forklm.speculative.config import SpeculativeConfig
from forklm.speculative.draft_length import BassDraftLength, CostRule, expected_tokens
from forklm.speculative.ngram import NGramIndex


# ---------------------------------------------------------------------------------- n-gram index
def reference_propose(prompt, samples, me, k, nmax, nmin):
    """Slow obvious version: for the longest suffix of prompt + samples[me] (nmax down to nmin)
    the continuations after each earlier occurrence in the prompt or any sample's tokens
    (an n-gram may start in the prompt's tail) with at least one token after it."""
    ctx = prompt + samples[me]
    out = set()
    for n in range(min(nmax, len(ctx)), nmin - 1, -1):
        key = ctx[-n:]
        for src, full in [(prompt, prompt)] + [(s, prompt + s) for s in samples]:
            off = len(full) - len(src)
            for end in range(n - 1, len(full) - 1):
                if end < off and src is not prompt:
                    continue  # inside the prompt: found in the prompt itself
                if full[end + 1 - n : end + 1] == key:
                    out.add(tuple(full[end + 1 : end + 1 + k]))
        if out:
            return out
    return {()}


@pytest.mark.parametrize("seed", range(30))
def test_ngram_index_proposes_a_real_continuation(seed):
    rnd = random.Random(seed)
    V = rnd.choice([3, 5, 9])
    prompt = [rnd.randrange(V) for _ in range(rnd.randint(1, 30))]
    samples = [[rnd.randrange(V) for _ in range(rnd.randint(1, 20))] for _ in range(rnd.randint(1, 4))]
    nmax = rnd.randint(1, 4)
    nmin = rnd.randint(1, nmax)
    index = NGramIndex(prompt, nmax, nmin)
    # samples grow in steps; the index is updated incrementally, as the engine does
    grown = [[] for _ in samples]
    for step in range(25):
        for i, s in enumerate(samples):
            grown[i].extend(s[len(grown[i]) : step + 1])  # in place: the index reads the live lists
            index.update(i, grown[i])
        me = rnd.randrange(len(samples))
        k = rnd.randint(1, 6)
        draft = index.propose(grown[me], k)
        want = reference_propose(prompt, grown, me, k, nmax, nmin)
        # the index keeps the latest occurrence it was given; any real continuation of the longest
        # matched suffix is right, and it must find one whenever one exists
        assert tuple(draft) in want, (draft, want)


def test_ngram_drafts_from_a_sibling():
    prompt = [1, 2, 3]
    index = NGramIndex(prompt, 3, 1)
    a, b = [7, 8, 9, 10, 11], [7, 8]
    index.update(0, a)
    index.update(1, b)
    assert index.propose(b, 3) == [9, 10, 11]
    assert index.propose(b, 0) == []


# ---------------------------------------------------------------------------------- Algorithm 1
def test_bass_algorithm_1_trace():
    ctl = BassDraftLength()
    assert ctl.length == 7
    trace = [([7, 1], 9), ([3, 0], 8), ([2], 6), ([0], 4), ([0], 2), ([0], 1), ([1], 3), ([3, 2], 5),
             ([5], 7), ([0, 6], 6)]
    for accepted, want in trace:
        assert ctl.update(accepted) == want, (accepted, want)
    for _ in range(40):
        ctl.update([ctl.length])
    assert ctl.length == 32  # l_limit


def test_bass_never_below_largest_accepted():
    ctl = BassDraftLength()
    rnd = random.Random(0)
    for _ in range(500):
        before = ctl.length
        acc = [rnd.randint(0, before) for _ in range(rnd.randint(1, 5))]
        after = ctl.update(acc)
        assert 1 <= after <= 32
        if max(acc) < before:
            assert after >= max(acc)


# ---------------------------------------------------------------------------------- cost rule
def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_cost_rule_turns_drafts_off_where_rows_cost_and_on_where_they_are_free():
    # compute-bound: a step costs in proportion to its rows; alpha 0.3 cannot pay for drafts
    rule = CostRule()
    rule.max_rows_base = 1024
    for rows in (64, 128, 192, 256, 64, 128):
        rule.observe_step(rows, 0.002 * rows)
    rule.accepted, rule.rejected = 3.0, 7.0
    assert rule.choose(7, 64, 64) == 0
    # weight-bound (n = 1): rows nearly free, drafts pay
    rule = CostRule()
    for rows in (1, 4, 8, 2, 6):
        rule.observe_step(rows, 0.03 + 0.0005 * rows)
    rule.accepted, rule.rejected = 7.0, 3.0
    assert rule.choose(7, 1, 1) >= 4


def test_cost_rule_sees_a_step_that_jumps_past_the_kernel_threshold():
    # a quantized model: up to 4 rows on the packed kernel (30 ms), wider steps on the dense copy (90 ms)
    rule = CostRule()
    for rows in (1, 2, 3, 4, 5, 8, 12):
        rule.observe_step(rows, 0.03 if rows <= 4 else 0.09)
    rule.accepted, rule.rejected = 8.0, 2.0  # alpha 0.8
    k = rule.choose(7, 1, 1)
    assert k == 3  # the longest draft that stays on the kernel
    assert rule.choose(7, 4, 4) == 0  # n = 4: any draft crosses the threshold and triples the step


def test_cost_rule_estimates_and_probes():
    rule = CostRule(probe_every=4, max_probe_every=8)
    assert rule.estimate(3) is None
    assert rule.choose(7, 1, 1) == 0  # nothing measured: no drafts until the plain step is timed
    rule.observe_step(2, 0.02)
    rule.observe_step(6, 0.06)
    assert abs(rule.estimate(4) - 0.04) < 1e-12  # interpolated
    assert abs(rule.estimate(12) - 0.12) < 1e-12  # above: in proportion to rows
    assert rule.estimate(1) == 0.02  # below: the smallest measured
    rule = CostRule(probe_every=4, max_probe_every=8)
    rule.max_rows_base = 1024
    for rows in (64, 128, 192, 256):
        rule.observe_step(rows, 0.002 * rows)
    rule.accepted, rule.rejected = 1.0, 9.0
    # off for probe_every steps, then a short probe; a probe that does not pay doubles the interval
    assert [rule.choose(7, 64, 64) for _ in range(4)] == [0, 0, 0, 2]
    assert [rule.choose(7, 64, 64) for _ in range(8)] == [0] * 7 + [2]
    assert rule.probing and rule.probe_sequences(64) == 8 and rule.probe_sequences(3) == 1
    assert [rule.choose(7, 64, 64) for _ in range(8)] == [0] * 7 + [2]  # capped at max_probe_every
    rule.choose(7, 64, 64)
    assert not rule.probing


# ---------------------------------------------------------------------------------- verification
def test_accepted_prefix():
    assert verify.accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert verify.accepted_prefix([1, 2, 3], [1, 5, 3, 4]) == 1
    assert verify.accepted_prefix([1], [2, 9]) == 0
    assert verify.accepted_prefix([], [7]) == 0


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-squared test of counts against probs (cells with expectation >= 5)."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= 5
    rest_obs = counts[~keep].sum()
    rest_exp = expected[~keep].sum()
    obs = torch.cat([counts[keep].double(), rest_obs.double().reshape(1)])
    exp = torch.cat([expected[keep], rest_exp.reshape(1)])
    if rest_exp < 5:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def tiny_distributions(temperature: float = 1.0):
    """Next-token distributions of two different tiny random Llamas (vocabulary 24) after one
    prompt: the target p and the drafter q, plus each model's distribution after every possible
    first token (for the bonus and second positions)."""
    from forklm.reference.forked_attention import PrefillAttention
    from forklm.reference.forked_kv import ForkedKVCache

    V = 24
    prompt = [3, 17, 5, 9]

    def dists(model):
        rows = []
        for first in [None] + list(range(V)):
            ids = prompt + ([first] if first is not None else [])
            c = model.config
            cache = ForkedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), 1, 1, model.dtype, model.device)
            logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), PrefillAttention(cache))
            rows.append(torch.softmax(logits[-1].double() / temperature, -1))
        return rows[0], torch.stack(rows[1:])

    target = tiny_llama(V, 32, 4, 2, 8, 48, 1, torch.float64, seed=11)
    draft = tiny_llama(V, 32, 4, 2, 8, 48, 1, torch.float64, seed=12)
    return dists(target), dists(draft)


def run_rejection(p0, p1, q0, q1, B: int, gen: torch.Generator):
    """Drafts of 2 tokens from q (the second conditioned on the first); returns the first emitted
    token of each row and the rows' accepted counts."""
    d0 = torch.multinomial(q0.expand(B, -1), 1, replacement=True, generator=gen).squeeze(1)
    d1 = torch.multinomial(q1[d0], 1, replacement=True, generator=gen).squeeze(1)
    draft = torch.stack([d0, d1], 1)
    p = torch.stack([p0.expand(B, -1), p1[d0], p1[d0]], 1)  # bonus position: any distribution works for token 0
    q = torch.stack([q0.expand(B, -1), q1[d0]], 1)
    u_acc = torch.rand(B, 2, generator=gen, dtype=torch.float64)
    u_draw = torch.rand(B, generator=gen, dtype=torch.float64)
    accepted, nxt = verify.rejection_sample(p, q, draft, u_acc, u_draw)
    first = torch.where(accepted > 0, d0, nxt)
    second = torch.where(accepted > 1, d1, torch.where(accepted == 1, nxt, torch.full_like(nxt, -1)))
    return first, second, accepted


def test_rejection_sampling_first_token_is_the_targets(monkeypatch):
    (p0, p1), (q0, q1) = tiny_distributions()
    V = p0.numel()
    assert 0.5 * (p0 - q0).abs().sum() > 0.2  # the drafter really differs
    gen = torch.Generator().manual_seed(0)
    B = 200_000
    first, second, accepted = run_rejection(p0, p1, q0, q1, B, gen)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p0) > 0.01
    # the second token, among rows that accepted the first draft token, follows p1 given the first
    both = second >= 0
    assert 0 < accepted.float().mean() < 2
    pair = torch.bincount(first[both] * V + second[both], minlength=V * V).view(V, V)
    for t in torch.argsort(p0, descending=True)[:3].tolist():
        if pair[t].sum() > 2000:
            assert chi2_pvalue(pair[t], p1[t]) > 0.01
    # the test has power: with q in place of p in the acceptance rule it fails
    monkeypatch.setattr(verify, "acceptance_probability", lambda p_x, q_x: torch.clamp(q_x / p_x, max=1.0))
    wrong, _, _ = run_rejection(p0, p1, q0, q1, B, torch.Generator().manual_seed(0))
    assert chi2_pvalue(torch.bincount(wrong, minlength=V), p0) < 1e-6


def test_rejection_sampling_accepts_everything_when_q_is_p():
    (p0, p1), _ = tiny_distributions()
    gen = torch.Generator().manual_seed(1)
    _, _, accepted = run_rejection(p0, p1, p0, p1, 5000, gen)
    assert bool((accepted == 2).all())


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa"}, "method must be one of"),
    ({"num_draft_tokens": 0}, "num_draft_tokens must be 'auto' or an integer in"),
    ({"num_draft_tokens": 33}, "num_draft_tokens"),
    ({"num_draft_tokens": True}, "num_draft_tokens"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"draft": 1}, "unknown keys"),
])
def test_bad_speculative_config_is_a_clear_error(bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SpeculativeConfig.from_any(bad)


def test_speculative_config_forms():
    assert SpeculativeConfig.from_any(None) is None and SpeculativeConfig.from_any(False) is None
    assert SpeculativeConfig.from_any("ngram") == SpeculativeConfig()
    assert SpeculativeConfig.from_any({"num_draft_tokens": 4}).fixed_length == 4
    with pytest.raises(InvalidArgumentError, match="speculative must be"):
        SpeculativeConfig.from_any(3)


def test_cost_rule_vetoes_drafts_that_measured_slower_and_retests_them():
    rule = CostRule(probe_every=4, max_probe_every=8)
    for rows in (4, 8, 12, 16):  # the step's model: rows almost free, so drafts look worth it
        rule.observe_step(rows, 0.04 + 0.0001 * rows)
    rule.accepted, rule.rejected = 8.0, 2.0
    assert rule.choose(3, 4, 4) == 3
    # but steps with drafts realized fewer tokens per second than plain steps at 4 sequences
    for _ in range(3):
        rule.observe_drafts(2, 4, draft_tokens=12, sequences=4, emitted=5)
        rule.observe_step(16, 0.2)
        rule.observe_step(4, 0.04)
    assert rule.rate[True][4] < rule.rate[False][4]
    assert rule.drafts_measured_slower(4) and rule.drafts_measured_slower(5) and not rule.drafts_measured_slower(16)
    rule.time_of = {r: 0.04 + 0.0001 * r for r in (4, 8, 12, 16)}  # a step model still wrong (timed elsewhere)
    decisions = [rule.choose(3, 4, 4) for _ in range(4)]
    assert decisions == [0, 0, 0, 3] and rule.full_probe  # a full-width probe re-tests the veto
    # a probe of one sequence in eight does not enter the realized rates
    rule.observe_drafts(1, 0, draft_tokens=2, sequences=1, emitted=2)
    rule.observe_step(66, 0.3)
    assert 64 not in rule.rate[True]


def test_cost_rule_never_drafts_for_wide_steps():
    rule = CostRule(probe_every=1)
    for rows in range(1, 40):
        rule.observe_step(rows, 0.03)  # rows free: the step's model would draft
    rule.accepted, rule.rejected = 9.0, 1.0
    assert rule.choose(7, 8, 8) > 0
    assert [rule.choose(7, 9, 9) for _ in range(5)] == [0] * 5  # no probes either
