"""The multi-request engine on the real default model: results equal `LLM.sample` run alone,
whatever the batch, the cache state, preemption or waves; no block leaks; scheduling order."""

import random

import pytest

from forklm import InvalidArgumentError, Request
from forklm.engine.request import Status
from forklm.reference.single_request import sample_single_request

from conftest import fail_forward_call

CODE = "def merge_sorted(a, b):\n    "
SYSTEM = "You are a careful Python reviewer. Answer briefly and precisely, with code when useful.\n"


def run_checked(engine, max_steps=10_000):
    """Steps the engine to completion, checking block integrity after every step."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.blocks_in_use() == 0, "blocks still held after every request finished"


def submit(llm, engine, specs):
    states = []
    for spec in specs:
        r = Request.from_any(spec)
        states.append(engine.add_request(llm.prompt_token_ids(r.prompt), r.params()))
    return states


def assert_same_as_sample(llm, specs, outputs):
    for spec, out in zip(specs, outputs):
        ref = sample_single_request(llm, **spec)  # the reference stack, not the engine
        assert len(out.samples) == len(ref.samples)
        for a, b in zip(out.samples, ref.samples):
            assert a.token_ids == b.token_ids, f"sample {a.index} of {spec['prompt']!r} differs"
            assert a.finish_reason == b.finish_reason and a.text == b.text
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def mixed_specs():
    return [
        dict(prompt=SYSTEM + "Write merge_sorted.", n=4, max_tokens=10, temperature=0.8, seed=1),
        dict(prompt=SYSTEM + "Explain binary search.", n=3, max_tokens=8, temperature=1.0, top_p=0.9, seed=2),
        dict(prompt=CODE, n=2, max_tokens=12, temperature=0.7, top_k=20, seed=3, stop=["\n\n"]),
        dict(prompt=[{"role": "user", "content": "hi"}], n=1, max_tokens=6, temperature=0, seed=4),
    ]


def test_generate_equals_sample_cold_and_warm(smollm2_f32):
    llm = smollm2_f32
    specs = mixed_specs()
    engine = llm.engine(num_blocks=400, block_size=16)
    states = submit(llm, engine, specs)
    run_checked(engine)
    assert_same_as_sample(llm, specs, [s.output for s in states])
    cold_cached = engine.metrics.cached_prompt_tokens
    # The two SYSTEM requests arrived together: one waited for the other's prefill and hit it.
    a, b = states[0].prompt_ids, states[1].prompt_ids
    common = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
    assert common >= 16 and cold_cached == common // 16 * 16
    # Warm: the same requests again on the same engine find their prompts cached.
    states = submit(llm, engine, specs)
    run_checked(engine)
    assert engine.metrics.cached_prompt_tokens - cold_cached >= sum(len(s.prompt_ids) // 16 * 16 - 16 for s in states)
    assert_same_as_sample(llm, specs, [s.output for s in states])


def test_llm_generate_api(smollm2_f32):
    llm = smollm2_f32
    specs = mixed_specs()[:2]
    outs = llm.generate(specs + [Request(CODE, n=2, max_tokens=5, seed=9)])
    assert len(outs) == 3 and [len(o.samples) for o in outs] == [4, 3, 2]
    assert outs[2].samples[0].token_ids == sample_single_request(llm, CODE, n=2, max_tokens=5, seed=9).samples[0].token_ids
    assert llm.default_engine().blocks_in_use() == 0


def test_preemption_and_waves_keep_results(smollm2_f32):
    llm = smollm2_f32
    specs = [
        dict(prompt=CODE, n=12, max_tokens=40, temperature=0.9, seed=11, ignore_eos=True),
        dict(prompt=SYSTEM + "Sort a list.", n=6, max_tokens=30, temperature=0.9, seed=12, ignore_eos=True),
    ]
    # 12 samples x 3 blocks each cannot all run in 40 blocks: waves and preemption.
    engine = llm.engine(num_blocks=40, block_size=16)
    states = submit(llm, engine, specs)
    run_checked(engine)
    assert engine.metrics.preempted_samples > 0
    assert_same_as_sample(llm, specs, [s.output for s in states])


def test_request_that_can_never_fit_is_rejected(smollm2_f32):
    llm = smollm2_f32
    engine = llm.engine(num_blocks=8, block_size=16)
    with pytest.raises(InvalidArgumentError, match="can never run"):
        engine.add_request(list(range(100, 200)), Request("x", max_tokens=64).params())
    assert not engine.has_unfinished()
    st = submit(llm, engine, [dict(prompt=CODE, n=2, max_tokens=4, seed=0)])[0]
    run_checked(engine)
    assert st.output.samples[0].token_ids == sample_single_request(llm, CODE, n=2, max_tokens=4, seed=0).samples[0].token_ids


def test_random_cancellations_release_everything(smollm2_f32):
    llm = smollm2_f32
    rng = random.Random(0)
    engine = llm.engine(num_blocks=120, block_size=16)
    specs = [
        dict(prompt=SYSTEM + f"Task {i}: write a function.", n=rng.randint(1, 5), max_tokens=rng.randint(4, 16),
             temperature=0.8, seed=i)
        for i in range(8)
    ]
    states = submit(llm, engine, specs)
    cancelled = set()
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        for st in states:
            if st.status is not Status.FINISHED and rng.random() < 0.08:
                engine.cancel(st.request_id)
                cancelled.add(st.request_id)
        engine.step()
        engine.check_integrity()
    assert cancelled and engine.blocks_in_use() == 0
    kept = [(spec, st) for spec, st in zip(specs, states) if st.request_id not in cancelled]
    assert_same_as_sample(llm, [k[0] for k in kept], [k[1].output for k in kept])
    for st in states:
        if st.request_id in cancelled and any(s.finish_reason == "cancelled" for s in st.output.samples):
            break
    else:
        pytest.fail("no sample reported finish_reason 'cancelled'")


def test_chunked_prefill_interleaves_with_decode(smollm2_f32):
    llm = smollm2_f32
    engine = llm.engine(num_blocks=200, block_size=16, max_batch_tokens=48)
    short = dict(prompt=CODE, n=2, max_tokens=20, temperature=0.8, seed=15, ignore_eos=True)  # seed 5 draws within 3e-7 of a CDF boundary at step 13
    long = dict(prompt=SYSTEM * 10 + "Now review this.", n=2, max_tokens=6, temperature=0.8, seed=6)
    a = submit(llm, engine, [short])[0]
    for _ in range(3):
        engine.step()
    assert a.status is Status.RUNNING
    b = submit(llm, engine, [long])[0]
    assert len(b.prompt_ids) > 3 * 48
    steps_prefilling, tokens_during = 0, 0
    while b.status in (Status.WAITING, Status.PREFILLING):
        before = sum(len(s.token_ids) for s in a.samples)
        engine.step()
        engine.check_integrity()
        steps_prefilling += 1
        tokens_during += sum(len(s.token_ids) for s in a.samples) - before
    assert steps_prefilling >= 3, "a long prompt must be prefilled in several chunks"
    assert tokens_during >= 2 * (steps_prefilling - 1), "running samples must keep decoding during the prefill"
    run_checked(engine)
    assert_same_as_sample(llm, [short, long], [a.output, b.output])


def test_cache_aware_order_and_aging(smollm2_f32):
    llm = smollm2_f32
    warm = dict(prompt=SYSTEM + "Warm the cache.", n=1, max_tokens=2, seed=0)
    for schedule, expected_first in (("cache-aware", "hit"), ("fcfs", "miss")):
        engine = llm.engine(num_blocks=300, block_size=16, max_batch_tokens=4, schedule=schedule)
        submit(llm, engine, [warm])
        run_checked(engine)
        miss, hit = submit(
            llm,
            engine,
            [
                dict(prompt=CODE * 3, n=1, max_tokens=2, seed=1),
                dict(prompt=SYSTEM + "A cached prefix.", n=1, max_tokens=2, seed=2),
            ],
        )
        engine.step()
        first = {"hit": hit, "miss": miss}[expected_first]
        other = miss if first is hit else hit
        assert first.status is not Status.WAITING and other.status is Status.WAITING, schedule
        run_checked(engine)
    # Aging: a request that waited max_wait_steps goes first even without a cache hit.
    engine = llm.engine(num_blocks=300, block_size=16, max_batch_tokens=4, max_wait_steps=0)
    submit(llm, engine, [warm])
    run_checked(engine)
    miss, hit = submit(llm, engine, [dict(prompt=CODE * 3, n=1, max_tokens=2, seed=1),
                                     dict(prompt=SYSTEM + "A cached prefix.", n=1, max_tokens=2, seed=2)])
    engine.step()
    assert miss.status is not Status.WAITING and hit.status is Status.WAITING
    run_checked(engine)


def test_block_aligned_and_fully_cached_prompts(smollm2_f32):
    llm = smollm2_f32
    ids = llm.tokenizer.encode(SYSTEM * 3)[:32]  # exactly two blocks of 16
    engine = llm.engine(num_blocks=100, block_size=16)
    specs = [dict(prompt=ids, n=3, max_tokens=8, temperature=0.9, seed=7)]
    for _ in range(2):  # the second time the whole prompt but its last token is cached
        states = submit(llm, engine, specs)
        run_checked(engine)
        assert_same_as_sample(llm, specs, [s.output for s in states])
    assert states[0].cached_tokens == 16  # the last block holds the recomputed last token


def test_generate_bad_input(smollm2_f32):
    llm = smollm2_f32
    with pytest.raises(InvalidArgumentError, match="unknown keys"):
        llm.generate([dict(prompt="x", bogus=1)])
    with pytest.raises(InvalidArgumentError, match="list"):
        llm.generate("not a list")
    with pytest.raises(InvalidArgumentError, match="temperature"):
        llm.generate([dict(prompt="x"), dict(prompt="y", temperature=-1)])
    with pytest.raises(InvalidArgumentError, match="prompt"):
        llm.generate([dict(n=2)])
    with pytest.raises(InvalidArgumentError, match="context length"):
        llm.generate([dict(prompt="x", max_tokens=10**6)])
    with pytest.raises(InvalidArgumentError):
        llm.engine(block_size=0)
    assert llm.default_engine().blocks_in_use() == 0
    assert llm.generate([dict(prompt="x", max_tokens=2, seed=1)])[0].samples[0].token_ids


def test_generate_failure_releases_blocks(smollm2_f32, monkeypatch):
    llm = smollm2_f32
    engine = llm.default_engine()
    real_forward = llm.model.forward
    fail_forward_call(monkeypatch, llm.model, 3)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([dict(prompt=CODE, n=3, max_tokens=8, seed=1), dict(prompt=SYSTEM, n=2, max_tokens=8, seed=2)])
    assert engine.blocks_in_use() == 0 and not engine.has_unfinished()
    engine.check_integrity()
    monkeypatch.setattr(llm.model, "forward", real_forward)
    out = llm.generate([dict(prompt=CODE, n=2, max_tokens=4, seed=1)])
    assert out[0].samples[0].token_ids == sample_single_request(llm, CODE, n=2, max_tokens=4, seed=1).samples[0].token_ids
