"""The engine at its edges: a failure in each phase of a step fails only that step's requests
(and only the request concerned where the failure is one request's), releases their blocks,
leaves the engine consistent and serving; `max_num_seqs` caps the decode batch; samples of one
request decode as one lane group (their tails one strided read)."""

from __future__ import annotations

import pytest

import forklm.engine.output_processor as output_processor
from forklm.engine.engine import Engine, EngineConfig
from forklm.engine.request import Status
from forklm.sampling.params import SamplingParams

from test_engine_fuzz import EOS, decode, reference, tiny_model

PROMPT_A = [1, 5, 7, 2, 9, 4, 4, 8, 1, 6]
PROMPT_B = [2, 2, 9, 11, 3, 7]
PROMPT_C = [8, 1, 12, 5]


def engine(**kw) -> Engine:
    return Engine(tiny_model(), decode, (EOS,), EngineConfig(block_size=2, num_blocks=200, **kw))


def params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"n": 3, "max_tokens": 8, "temperature": 1.0, "seed": seed, "ignore_eos": True, **kw})


def same_as_reference(req, prompt, p) -> None:
    ref = reference(prompt, p)
    assert req.error is None and req.output is not None
    assert [s.token_ids for s in req.output.samples] == [s.token_ids for s in ref.samples]


def run_checked(eng: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            break
        eng.step()
        eng.check_integrity()
    assert not eng.has_unfinished() and eng.blocks_in_use() == 0


def _fail_once(monkeypatch, obj, name, at_call: int):
    real = getattr(obj, name)
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise RuntimeError(f"injected failure in {name}")
        return real(*a, **k)

    monkeypatch.setattr(obj, name, flaky)


@pytest.mark.parametrize("phase", ["forward", "draw", "prefix-insert"])
def test_a_failing_phase_fails_only_the_requests_of_that_step(monkeypatch, phase):
    eng = engine()
    pa, pb, pc = params(1), params(2, n=2), params(3, n=1)
    a = eng.add_request(PROMPT_A, pa)
    b = eng.add_request(PROMPT_B, pb)
    for _ in range(3):  # both prefilled and decoding
        eng.step()
    assert a.status is Status.RUNNING and b.status is Status.RUNNING
    if phase == "forward":
        _fail_once(monkeypatch, tiny_model(), "forward", 1)
    elif phase == "draw":
        _fail_once(monkeypatch, output_processor, "draw_rows", 1)
    c = None
    if phase == "prefix-insert":  # c's prompt completes in a step of its own: its insertion fails
        c = eng.add_request(PROMPT_C, pc)
        _fail_once(monkeypatch, eng.kv_manager.radix, "insert", 1)
        eng.step()
        eng.check_integrity()
        assert c.status is Status.FINISHED and "injected" in str(c.error) and c.output is None
        monkeypatch.undo()
        run_checked(eng)
        same_as_reference(a, PROMPT_A, pa)
        same_as_reference(b, PROMPT_B, pb)
    else:
        ended = eng.step()
        eng.check_integrity()
        assert {r.request_id for r in ended} == {a.request_id, b.request_id}
        assert all("injected" in str(r.error) and r.output is None for r in (a, b))
        assert eng.blocks_in_use() == 0
        monkeypatch.undo()
    # The engine keeps serving: a later request runs to the reference result.
    d = eng.add_request(PROMPT_C, pc)
    run_checked(eng)
    same_as_reference(d, PROMPT_C, pc)


def test_a_decode_error_fails_only_its_request():
    """A stop-string check that cannot decode (a tokenizer error) ends that request with the
    error; the other request in the same steps runs to its reference result."""
    def bad_decode(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    eng = Engine(tiny_model(), bad_decode, (EOS,), EngineConfig(block_size=2, num_blocks=200))
    pa = params(4, stop=("B",))  # stop strings decode every step
    pb = params(5, n=2)  # stop tokens only; its final text is decoded only at the end
    a = eng.add_request(PROMPT_A, pa)
    b = eng.add_request(PROMPT_B, pb)
    events = []
    b.on_event = events.append
    for _ in range(200):
        if a.status is Status.FINISHED:
            break
        eng.step()
        eng.check_integrity()
    assert isinstance(a.error, UnicodeDecodeError) and a.output is None
    assert b.status is not Status.FINISHED and b.error is None  # b goes on
    while b.status is not Status.FINISHED:
        eng.step()
        eng.check_integrity()
    # b's final text cannot be decoded either: it fails at its end, its tokens streamed until then.
    assert isinstance(b.error, UnicodeDecodeError)
    streamed = [e.token_id for e in events if not e.done and e.sample_index == 0]
    assert streamed == reference(PROMPT_B, pb).samples[0].token_ids[: pb.max_tokens - 1]
    assert events[-1].done and events[-1].error is b.error
    assert eng.blocks_in_use() == 0


def test_a_raising_event_callback_does_not_stop_the_request():
    eng = engine()
    p = params(6)
    a = eng.add_request(PROMPT_A, p)

    def boom(event):
        raise RuntimeError("consumer gone")

    a.on_event = boom
    run_checked(eng)
    same_as_reference(a, PROMPT_A, p)


def test_max_num_seqs_caps_the_decode_batch():
    eng = engine(max_num_seqs=3)
    p1, p2 = params(7, n=5), params(8, n=2)
    a = eng.add_request(PROMPT_A, p1)
    b = eng.add_request(PROMPT_B, p2)
    peak = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        peak = max(peak, sum(len(r.running) for r in eng.active))
    assert peak == 3
    same_as_reference(a, PROMPT_A, p1)
    same_as_reference(b, PROMPT_B, p2)


def test_samples_decode_as_one_lane_group(monkeypatch):
    """The fresh samples of a request get side-by-side runs of blocks, so every decode step reads
    their tails as one strided view (one TailGroup of n rows), and the result is the reference's."""
    eng = engine()
    plans = []
    real_plan = eng.runner.planner.plan

    def spy(rows, chunks):
        plan = real_plan(rows, chunks)
        plans.append(plan)
        return plan

    monkeypatch.setattr(eng.runner.planner, "plan", spy)
    p = params(9, n=6, max_tokens=12)
    a = eng.add_request(PROMPT_A, p)
    run_checked(eng)
    same_as_reference(a, PROMPT_A, p)
    decode_plans = [pl for pl in plans if pl.num_decode == 6]
    assert len(decode_plans) >= 10
    assert all(len(pl.tails) == 1 and pl.tails[0].num_rows == 6 for pl in decode_plans)


@pytest.mark.parametrize("poison", ["nan", "-inf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])  # argmax and the sampler (the C++ one where it runs)
def test_non_finite_logits_stop_their_request_with_a_clear_error(monkeypatch, poison, temperature):
    """A row of logits holding NaN (or only -inf) is a model gone wrong: no token is drawn from it (the
    sampler and argmax would each pick some token); its request stops with ModelOutputError, the other
    request in the same steps runs to its reference result, and no block leaks."""
    from forklm.errors import ModelOutputError

    eng = engine()
    real = eng.model.forward
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        logits = real(*args, **kwargs).clone()  # (an inference tensor is not written in place)
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step: the first row's logits
            logits[0] = float(poison)
        return logits

    monkeypatch.setattr(eng.model, "forward", poisoned)
    pa, pb = params(6, temperature=temperature), params(7, n=2, temperature=temperature)
    a, b = eng.add_request(PROMPT_A, pa), eng.add_request(PROMPT_B, pb)
    run_checked(eng)
    failed = [r for r in (a, b) if r.error is not None]
    assert len(failed) == 1 and isinstance(failed[0].error, ModelOutputError)
    assert "not finite" in str(failed[0].error)
    other, prompt, p = (b, PROMPT_B, pb) if failed[0] is a else (a, PROMPT_A, pa)
    same_as_reference(other, prompt, p)
    assert eng.blocks_in_use() == 0


def test_a_short_request_starts_beside_a_long_prefill():
    """The chunked-prefill budget is shared: a short request submitted while a long prompt prefills
    is admitted in the next step and has its first token a step later, not after the whole prompt;
    both still equal their references."""
    eng = Engine(tiny_model(), decode, (EOS,), EngineConfig(block_size=2, num_blocks=800, max_batch_tokens=64))
    long_prompt = [(7 * i + 1) % 13 for i in range(600)]  # ~10 steps of prefill alone
    long_prompt = [t if t != EOS else 4 for t in long_prompt]
    pl, ps = params(8, n=2, max_tokens=4), params(9, n=1, max_tokens=4)
    long_req = eng.add_request(long_prompt, pl)
    eng.step()
    eng.step()
    short = eng.add_request(PROMPT_C, ps)
    before = long_req.prompt_seq.num_computed
    eng.step()  # admits the short request: the long prompt's chunk gives way (an eighth of the budget)
    assert 0 < long_req.prompt_seq.num_computed - before <= 64 // 8
    first, steps = None, 1
    while first is None and steps < 50:
        if short.samples and short.samples[0].token_ids:
            first = steps
            break
        eng.step()
        steps += 1
    assert first is not None and first <= 2, first
    assert long_req.status is not Status.FINISHED  # the long prompt was still prefilling
    run_checked(eng)
    same_as_reference(short, PROMPT_C, ps)
    same_as_reference(long_req, long_prompt, pl)
    assert eng.blocks_in_use() == 0


def test_a_long_prefill_keeps_its_budget_while_the_waiting_request_cannot_start():
    """Running prompts give way only to a request that can be admitted now: one deferred to the
    in-flight prefill of its own prefix (it will hit the cache) leaves the long prompt its whole
    budget, and both still equal their references."""
    eng = Engine(tiny_model(), decode, (EOS,), EngineConfig(block_size=2, num_blocks=800, max_batch_tokens=64))
    long_prompt = [(7 * i + 1) % 13 for i in range(600)]
    long_prompt = [t if t != EOS else 4 for t in long_prompt]
    pl, ps = params(8, n=2, max_tokens=4), params(9, n=1, max_tokens=4)
    long_req = eng.add_request(long_prompt, pl)
    eng.step()
    follower_prompt = long_prompt[:300] + [3, 5, 6]  # shares 300 tokens with the prefill in flight
    follower = eng.add_request(follower_prompt, ps)
    before = long_req.prompt_seq.num_computed
    eng.step()
    assert follower in eng.waiting  # deferred: it waits for the shared prefix to reach the cache
    assert long_req.prompt_seq.num_computed - before == 64  # the whole budget, not an eighth
    run_checked(eng)
    same_as_reference(follower, follower_prompt, ps)
    same_as_reference(long_req, long_prompt, pl)
    assert eng.blocks_in_use() == 0
