"""Jump-forward on the real default model: a run of tokens the grammar forces is appended in one
engine step (a multi-token extend of the running sample), with the model's own log-probs; its
output matches the constraint; stop rules, max_tokens, streaming, batching, preemption and
cancellation all hold during a jump, and no block leaks."""

import json
import re

import jsonschema
import pytest
import torch
from test_constraints import PET_PROMPT, PET_SCHEMA

from forklm import Request
from forklm.reference.forked_attention import PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache

# two free digits, then a literal the grammar forces to the end
FORCED_RE = r"[1-9][0-9]: the quick brown fox jumps over the lazy dog"
FORCED_TEXT = ": the quick brown fox jumps over the lazy dog"


def run(engine, llm, *specs, check_each_step=True):
    states = [engine.add_request(llm.prompt_token_ids(s["prompt"]), Request.from_any(s).params()) for s in specs]
    while engine.has_unfinished():
        engine.step()
        if check_each_step:
            engine.check_integrity()
    assert engine.blocks_in_use() == 0
    for st in states:
        assert st.error is None, st.error
    return [st.output for st in states]


def teacher_forced_logprobs(llm, prompt_ids, token_ids):
    """The model's log-prob of each sample token, from one plain prefill over prompt + sample."""
    ids = list(prompt_ids) + list(token_ids)
    c = llm.config
    cache = ForkedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(ids), 1, 1, llm.model.dtype, llm.model.device)
    logits = llm.model.forward(torch.tensor(ids), torch.arange(len(ids)), PrefillAttention(cache))
    P = len(prompt_ids)
    lp = torch.log_softmax(logits[P - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def test_a_forced_run_is_appended_in_one_step(smollm2_f32):
    llm = smollm2_f32
    spec = {"prompt": "Two digits and a sentence: ", "n": 1, "max_tokens": 40, "temperature": 1.0, "seed": 31, "regex": FORCED_RE}
    jump_engine, mask_engine = llm.engine(), llm.engine()
    (jump,) = run(jump_engine, llm, spec)
    (masks,) = run(mask_engine, llm, dict(spec, jump_forward=False))
    s = jump.samples[0]
    assert re.fullmatch(FORCED_RE, s.text) and s.finish_reason == "stop"
    # prefill (draws the first digit), decode (draws the second), one extend of the whole forced run
    assert jump_engine.metrics.steps == 3
    assert mask_engine.metrics.steps == len(masks.samples[0].token_ids)
    # the run is the tokenizer's canonical split of the forced text
    forced = s.token_ids[2:]
    assert llm.decode(forced) == FORCED_TEXT
    assert forced == llm.tokenizer.encode(FORCED_TEXT)
    assert len(forced) >= 8 and mask_engine.metrics.steps > 3 * jump_engine.metrics.steps
    # one extend: the second digit and the whole run after it
    assert jump_engine.metrics.extends == 1 and jump_engine.metrics.extend_tokens == 1 + len(forced)
    assert mask_engine.metrics.extends == 0


def test_forced_tokens_logprobs_are_the_models(smollm2_f32):
    llm = smollm2_f32
    out = llm.sample(PET_PROMPT, n=4, max_tokens=80, temperature=1.0, seed=32, json_schema=PET_SCHEMA, top_logprobs=2)
    prompt_ids = llm.prompt_token_ids(PET_PROMPT)
    for s in out.samples:
        jsonschema.validate(json.loads(s.text), PET_SCHEMA)
        assert len(s.logprobs) == len(s.top_logprobs) == len(s.token_ids)
        ref = teacher_forced_logprobs(llm, prompt_ids, s.token_ids)
        assert (ref - torch.tensor(s.logprobs)).abs().max().item() < 1e-3
        for tok, lp, top in zip(s.token_ids, s.logprobs, s.top_logprobs):
            assert top[0][1] >= lp - 1e-4 and len(top) == 2


def test_jump_forward_takes_fewer_steps_and_same_seed_same_output(smollm2_f32):
    llm = smollm2_f32
    spec = {"prompt": PET_PROMPT, "n": 8, "max_tokens": 80, "temperature": 1.0, "seed": 33, "json_schema": PET_SCHEMA}
    e1, e2 = llm.engine(), llm.engine()
    (a,) = run(e1, llm, spec)
    (b,) = run(e2, llm, dict(spec, jump_forward=False))
    assert e1.metrics.steps * 1.5 <= e2.metrics.steps
    for s in a.samples + b.samples:
        jsonschema.validate(json.loads(s.text), PET_SCHEMA)
    (again,) = run(llm.engine(), llm, spec)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in a.samples]


def test_streamed_tokens_equal_the_result(smollm2_f32):
    llm = smollm2_f32
    engine = llm.engine()
    events = []
    params = Request(PET_PROMPT, n=3, max_tokens=80, seed=34, json_schema=PET_SCHEMA).params()
    st = engine.add_request(llm.prompt_token_ids(PET_PROMPT), params, on_event=events.append)
    engine.run()
    out = st.output
    for s in out.samples:
        mine = [e for e in events if not e.done and e.sample_index == s.index]
        assert [e.token_id for e in mine] == s.token_ids
        assert [e.logprob for e in mine] == s.logprobs
        assert mine[-1].finish_reason == s.finish_reason == "stop" and mine[-1].sample.text == s.text
        assert all(e.finish_reason is None for e in mine[:-1])


def test_unconstrained_samples_unchanged_beside_jumps(smollm2_f32):
    llm = smollm2_f32
    free = {"prompt": "def add(a, b):\n    ", "n": 4, "max_tokens": 24, "temperature": 1.0, "seed": 35}
    jumping = {"prompt": "Two digits and a sentence: ", "n": 4, "max_tokens": 40, "temperature": 1.0, "seed": 35, "regex": FORCED_RE}
    together = run(llm.engine(), llm, free, jumping, dict(jumping, prompt=PET_PROMPT, json_schema=PET_SCHEMA, regex=None))
    (alone,) = run(llm.engine(), llm, free)
    assert [s.token_ids for s in together[0].samples] == [s.token_ids for s in alone.samples]
    assert all(re.fullmatch(FORCED_RE, s.text) for s in together[1].samples)


def test_stop_rules_and_max_tokens_apply_to_forced_tokens(smollm2_f32):
    llm = smollm2_f32
    base = {"prompt": "Two digits and a sentence: ", "n": 2, "max_tokens": 40, "temperature": 1.0, "seed": 36, "regex": FORCED_RE}
    # a stop string inside the forced run
    (out,) = run(llm.engine(), llm, dict(base, stop=["brown"]))
    assert all(s.stop_reason == "brown" and s.text.endswith(": the quick ") for s in out.samples)
    # a stop token inside the forced run
    fox = llm.tokenizer.encode(" fox")
    assert len(fox) == 1
    (out,) = run(llm.engine(), llm, dict(base, stop_token_ids=fox))
    assert all(s.stop_reason == fox[0] and s.token_ids[-1] == fox[0] and s.text.endswith(" brown") for s in out.samples)
    # max_tokens cuts the run: forced tokens count
    (out,) = run(llm.engine(), llm, dict(base, max_tokens=6))
    assert all(s.finish_reason == "length" and len(s.token_ids) == 6 for s in out.samples)
    assert all(FORCED_TEXT.startswith(llm.decode(s.token_ids[2:])) for s in out.samples)


def test_preemption_during_jumps_leaks_nothing_and_changes_nothing(smollm2_f32):
    llm = smollm2_f32
    specs = [{"prompt": PET_PROMPT, "n": 8, "max_tokens": 80, "temperature": 1.0, "seed": 37, "json_schema": PET_SCHEMA},
             {"prompt": "Two digits and a sentence: ", "n": 6, "max_tokens": 40, "temperature": 1.0, "seed": 38, "regex": FORCED_RE},
             {"prompt": "Numbers: ", "n": 4, "max_tokens": 40, "temperature": 0.9, "seed": 39, "ignore_eos": True}]
    tight = llm.engine(num_blocks=36, block_size=16)
    outs = run(tight, llm, *specs)
    assert tight.metrics.preempted_samples > 0
    roomy = run(llm.engine(), llm, *specs)
    for a, b in zip(outs, roomy):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    for s in outs[0].samples:
        jsonschema.validate(json.loads(s.text), PET_SCHEMA)


def test_cancel_during_a_jump_releases_every_block(smollm2_f32):
    llm = smollm2_f32
    engine = llm.engine()
    params = Request(PET_PROMPT, n=6, max_tokens=80, seed=40, json_schema=PET_SCHEMA).params()
    st = engine.add_request(llm.prompt_token_ids(PET_PROMPT), params)
    for _ in range(20):
        engine.step()
        engine.check_integrity()
        if any(s.ahead for s in st.samples):
            break
    assert any(s.ahead for s in st.samples), "no sample got a forced run"
    assert engine.cancel(st.request_id)
    engine.step()
    engine.check_integrity()
    assert engine.blocks_in_use() == 0 and not engine.has_unfinished()
    assert all(s.finish_reason in ("cancelled", "stop") for s in st.output.samples)


def test_jump_forward_must_be_a_bool(smollm2_f32):
    from forklm import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"^jump_forward must be True or False"):
        smollm2_f32.sample("x", max_tokens=4, regex="[0-9]+", jump_forward="yes")


def test_bench_constrained_modes_run_and_validate(smollm2_f32):
    from bench.constrained import run_mode

    masked, _ = run_mode(smollm2_f32, "masks-only", 4, 256, 1)
    jump, _ = run_mode(smollm2_f32, "jump-forward", 4, 256, 1)
    free, _ = run_mode(smollm2_f32, "unconstrained", 4, 256, 1, length=20)
    assert masked["valid"] == jump["valid"] == 4
    assert jump["steps"] * 1.5 <= masked["steps"] and free["tokens"] == 80
    assert masked["masks"] > jump["masks"] > 0


def test_jumps_with_preemption_and_random_cancels_keep_the_books(smollm2_f32):
    """Constrained (jumping) and free requests on a pool too small for all of them, some
    cancelled at random steps: integrity after every step, no block left at the end, every
    finished constrained sample valid."""
    import random

    llm = smollm2_f32
    rng = random.Random(41)
    engine = llm.engine(num_blocks=40, block_size=16)
    kinds = [{"prompt": PET_PROMPT, "max_tokens": 80, "json_schema": PET_SCHEMA},
             {"prompt": "Two digits and a sentence: ", "max_tokens": 40, "regex": FORCED_RE},
             {"prompt": "Numbers: ", "max_tokens": 30, "ignore_eos": True}]
    states = []
    for i in range(9):
        spec = dict(kinds[i % 3], n=rng.choice([1, 3, 5]), temperature=1.0, seed=100 + i)
        states.append((spec, engine.add_request(llm.prompt_token_ids(spec["prompt"]), Request.from_any(spec).params())))
    cancel_at = {rng.randrange(2, 30): states[i][1].request_id for i in (1, 4, 6)}
    step = 0
    while engine.has_unfinished():
        if step in cancel_at:
            engine.cancel(cancel_at[step])
        engine.step()
        engine.check_integrity()
        step += 1
    assert engine.blocks_in_use() == 0 and engine.metrics.preempted_samples > 0
    for spec, st in states:
        assert st.error is None
        for s in st.output.samples:
            if s.finish_reason == "stop" and "json_schema" in spec:
                jsonschema.validate(json.loads(s.text), PET_SCHEMA)
            if s.finish_reason == "stop" and "regex" in spec:
                assert re.fullmatch(FORCED_RE, s.text)
