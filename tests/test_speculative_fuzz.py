"""Speculative sampling under the engine fuzz test's scenarios (tests/test_engine_fuzz.py): random
block sizes, pools just above a request's minimum (preemption), chunked prefill, both schedules,
every shared-attention mode, random cancellations, on the tiny float64 Llama (vocabulary 13, so
n-gram drafts are found and rejected often). With the n-gram drafter (a point-mass drafter) every
request must give exactly the tokens, finish reasons, texts and log-probs of the single-request
reference without speculation; integrity is checked after every step, no block is left at the
end, and every token sequence inserted into the radix prefix cache is a prefix of a prompt plus
a reference sample (an unverified draft token never enters it)."""

from __future__ import annotations

import random
from collections import Counter

import torch
from test_engine_fuzz import _run, describe, draw_scenario, reference

from forklm.cache.radix_cache import RadixCache
from forklm.engine.engine import Engine
from forklm.sampling.params import SamplingParams

SEEDS = range(160)


def spec_scenario(seed: int) -> dict:
    sc = draw_scenario(seed)
    rnd = random.Random(10_000 + seed)
    k = rnd.choice(["auto", 1, 2, 3, 5, 8])
    sc["engine"]["speculative"] = {"method": "ngram", "num_draft_tokens": k, "ngram_max": rnd.choice([1, 2, 3])}
    return sc


def run_checked(sc: dict, cov: Counter, inserted: list, engines: list):
    """Runs a speculative scenario (the engine fuzz's `_run`, every check after every step) and
    checks what every speculative fuzz checks: the radix cache received only verified tokens
    (prefixes of the reference's samples). Counts drafted, accepted and rejected tokens in `cov`
    and returns the last engine's speculation metrics."""
    inserted.clear()
    engines.clear()
    _run(sc, cov)
    allowed = []
    for r in sc["requests"]:
        ref = reference(r["prompt"], SamplingParams(**r["params"]))
        allowed += [tuple(r["prompt"]) + tuple(s.token_ids) for s in ref.samples]
    for toks in inserted:
        assert any(a[: len(toks)] == toks for a in allowed), f"radix insert of unverified tokens {toks}"
    m = engines[-1].metrics.speculative
    cov["draft_tokens"] += m.draft_tokens
    cov["accepted_tokens"] += m.accepted_tokens
    cov["rejected_tokens"] += m.draft_tokens - m.accepted_tokens
    return m


def test_speculative_fuzz(monkeypatch):
    inserted: list[tuple[int, ...]] = []
    real_insert = RadixCache.insert

    def recording_insert(self, tokens, blocks):
        inserted.append(tuple(tokens))
        return real_insert(self, tokens, blocks)

    monkeypatch.setattr(RadixCache, "insert", recording_insert)
    real_init = Engine.__init__
    engines = []

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", keep)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cov: Counter = Counter()
    failures = []
    try:
        for seed in SEEDS:
            sc = spec_scenario(seed)
            try:
                run_checked(sc, cov, inserted, engines)
            except AssertionError as e:
                failures.append((seed, f"{e}\n{describe(sc)}"))
    finally:
        torch.set_num_threads(threads)
    assert not failures, f"{len(failures)} of {len(SEEDS)} failed (seeds {[s for s, _ in failures]}):\n{failures[0][1]}"
    for what in ("draft_tokens", "accepted_tokens", "rejected_tokens", "preempted_samples", "cancel_running"):
        assert cov[what] > 0, f"no scenario exercised {what}: {dict(cov)}"


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    for s in (int(a) for a in sys.argv[1:]):
        sc = spec_scenario(s)
        print(describe(sc))
        c = Counter()
        _run(sc, c)
        print("ok", dict(c))
