"""Speculative sampling on the real default model (float32, dense weights: the exact reference):
with the n-gram drafter (point masses) the samples are token for token those of decoding without
speculation, at temperature 0 and 0.8 and n in {1, 8, 64}, all in one engine whose pool is small
enough that samples are preempted, with a request cancelled mid-speculation; integrity after every
step and no block left at the end."""

from __future__ import annotations

import pytest

# code that repeats itself, so drafts are proposed and often accepted
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
OTHER = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"

REQUESTS = [  # (prompt, sampling params)
    (CODE, dict(n=1, max_tokens=40, temperature=0.0, seed=1)),
    (CODE, dict(n=8, max_tokens=32, temperature=0.8, seed=2)),
    (OTHER, dict(n=8, max_tokens=32, temperature=0.0, seed=3)),
    (CODE, dict(n=64, max_tokens=12, temperature=0.8, top_p=0.95, seed=4)),
    (OTHER, dict(n=64, max_tokens=10, temperature=0.0, seed=5)),
]


# Known limit (docs/design.md, "Batch invariance"): on the float32 dense path a row's products go through
# MKL, whose result for a row changes between 3 and 4 rows in the product, so a sample matches its lone
# run to float rounding only and a draw near a CDF boundary can pick another token, with or without
# preemption or speculation (first seen on an AVX2-only EPYC; passes as is on the Zen 4 / Zen 5 EPYCs
# since the attention is batch-invariant, 2026-12-02).
@pytest.mark.xfail(strict=False,
                   reason="on the float32 dense path a row's products depend on the rows beside it "
                          "(docs/design.md 'Batch invariance'; README 'Not here yet')")
@pytest.mark.parametrize("num_draft_tokens", [3, "auto"])
def test_speculative_samples_equal_regular_ones_under_preemption_and_cancels(smollm2_f32, num_draft_tokens):
    from forklm.sampling.params import SamplingParams

    llm = smollm2_f32
    refs = [llm.sample(prompt, speculative=False, **kw) for prompt, kw in REQUESTS]
    # 48 blocks of 16 tokens: the two n=64 requests cannot all run at once, samples are preempted
    engine = llm.engine(speculative={"method": "ngram", "num_draft_tokens": num_draft_tokens},
                        num_blocks=48, block_size=16, max_batch_tokens=256)
    states = [engine.add_request(llm.prompt_token_ids(p), SamplingParams(**kw)) for p, kw in REQUESTS]
    doomed = engine.add_request(llm.prompt_token_ids(CODE), SamplingParams(n=8, max_tokens=64, seed=9))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps == 6:
            assert engine.cancel(doomed.request_id)
    assert {s.finish_reason for s in doomed.output.samples} <= {"cancelled", "stop"}
    m = engine.metrics
    assert m.preempted_samples > 0
    if num_draft_tokens == 3:
        assert m.speculative.draft_tokens > 100 and m.speculative.accepted_tokens > 0
    for st, ref in zip(states, refs, strict=True):
        for got, want in zip(st.output.samples, ref.samples, strict=True):
            assert got.token_ids == want.token_ids
            assert got.finish_reason == want.finish_reason
            assert got.text == want.text
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    engine.clear_prefix_cache()
    assert engine.blocks_in_use() == 0
