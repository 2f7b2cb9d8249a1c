"""Time-budgeted generation (`time_budget_s`): at the deadline finished samples are returned as
they are and unfinished ones end with finish_reason "time", their tokens a prefix of the
unbudgeted run's with the same seed; no blocks leak; a budget never hit changes nothing."""

from __future__ import annotations

import pytest

from forklm.errors import InvalidArgumentError

PROMPT = "def fibonacci(n):\n    "


def _check_prefix(budgeted, full) -> None:
    for b, f in zip(budgeted.samples, full.samples):
        assert b.index == f.index
        if b.finish_reason == "time":
            assert b.token_ids == f.token_ids[: len(b.token_ids)]
            assert b.logprobs == pytest.approx(f.logprobs[: len(b.logprobs)], rel=1e-5, abs=1e-6)
        else:
            assert (b.token_ids, b.finish_reason, b.text) == (f.token_ids, f.finish_reason, f.text)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_budget_expires_mid_generation(smollm2_f32, speculative):
    llm = smollm2_f32
    engine = llm.engine(speculative=speculative)
    common = dict(n=4, max_tokens=4000, temperature=0.8, seed=7, ignore_eos=True)
    from forklm.sampling.params import SamplingParams

    # a short request that finishes well inside the budget, and a long one that cannot
    short = engine.add_request(llm.prompt_token_ids(PROMPT), SamplingParams(n=2, max_tokens=2, seed=3, time_budget_s=60.0))
    long = engine.add_request(llm.prompt_token_ids(PROMPT), SamplingParams(**common, time_budget_s=0.5))
    engine.run()
    engine.check_integrity()
    engine.clear_prefix_cache()
    assert engine.blocks_in_use() == 0  # every block went back (the prefix cache emptied)
    assert not engine.has_unfinished()
    assert [s.finish_reason for s in short.output.samples] == ["length", "length"]
    out = long.output
    assert all(s.finish_reason == "time" for s in out.samples)
    assert all(len(s.token_ids) < 4000 for s in out.samples)
    assert all(len(s.logprobs) == len(s.token_ids) for s in out.samples)
    # the same seed without a budget, on as many tokens as the longest budgeted sample drew
    longest = max(len(s.token_ids) for s in out.samples) or 1
    full = llm.sample(PROMPT, **{**common, "max_tokens": longest})
    _check_prefix(out, full)
    for s in out.samples:
        assert s.text == llm.decode(s.token_ids)


def test_budget_never_hit_changes_nothing(smollm2_f32):
    kw = dict(n=3, max_tokens=12, temperature=0.8, seed=11)
    a = smollm2_f32.sample(PROMPT, **kw)
    b = smollm2_f32.sample(PROMPT, **kw, time_budget_s=600.0)
    assert [(s.token_ids, s.finish_reason, s.text) for s in a.samples] == \
        [(s.token_ids, s.finish_reason, s.text) for s in b.samples]
    smollm2_f32.default_engine().check_integrity()


def test_budget_through_sample_and_generate(smollm2_f32):
    out = smollm2_f32.sample(PROMPT, n=2, max_tokens=4000, ignore_eos=True, seed=5, time_budget_s=0.3)
    assert {s.finish_reason for s in out.samples} == {"time"}
    outs = smollm2_f32.generate([{"prompt": PROMPT, "max_tokens": 3, "seed": 1},
                                 {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "seed": 2,
                                  "time_budget_s": 0.3}])
    assert outs[0].samples[0].finish_reason == "length"
    assert outs[1].samples[0].finish_reason == "time"
    engine = smollm2_f32.default_engine()
    engine.check_integrity()
    assert not engine.active and not engine.waiting


@pytest.mark.parametrize("bad", [0, -1, 0.0, True, "1", float("nan"), float("inf")])
def test_bad_budget_names_the_field(smollm2_f32, bad):
    with pytest.raises(InvalidArgumentError, match="time_budget_s"):
        smollm2_f32.sample(PROMPT, max_tokens=2, time_budget_s=bad)
