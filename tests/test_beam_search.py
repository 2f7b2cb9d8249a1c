"""Beam search on the engine (forklm/sampling/beam.py): token for token transformers'
`generate(num_beams=k)` in float32, diverse beam search against the slow reference
(forklm/reference/beam_search.py), beams sharing blocks, batching beside sampling requests,
memory pressure, and the errors a bad request gets."""

from __future__ import annotations

import pytest
import torch

from forklm.errors import InvalidArgumentError
from forklm.reference.beam_search import beam_search_reference
from forklm.sampling.params import SamplingOptions
from forklm.sampling.sample_state import stop_token_set

CHAT = [{"role": "user", "content": "What is 2+2? Answer in one word."}]
TEXT = "The capital of France is"
CODE = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm(smollm2_f32):
    return smollm2_f32


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def hf_beams(hf, llm, ids, k, max_tokens, **kw):
    """transformers' k hypotheses (generated ids, pads stripped after a stop) and their scores."""
    eos = list(llm.eos_token_ids)
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, max_new_tokens=max_tokens,
                        do_sample=False, return_dict_in_generate=True, output_scores=True, eos_token_id=eos,
                        pad_token_id=eos[0], **kw)
    out = []
    for i in range(k):
        gen = g.sequences[i, len(ids):].tolist()
        stop = next((j for j, t in enumerate(gen) if t in eos), None)
        out.append((gen if stop is None else gen[: stop + 1],
                    g.sequences_scores[i].item() if k > 1 else None))
    return out


def assert_same_hypotheses(mine, theirs):
    assert len(mine) == len(theirs)
    for s, (tokens, score) in zip(mine, theirs):
        assert s.token_ids == tokens
        if score is not None:
            assert s.score == pytest.approx(score, rel=1e-4, abs=1e-5)


# (k, prompt, length_penalty, early_stopping): every width 1..8, each rule of early stopping, a
# positive / fractional / large length penalty, and prompts whose beams end by EOS (the chat one)
CASES = [
    (1, TEXT, 1.0, False),
    (2, CHAT, 0.5, True),
    (3, CODE, 2.0, "never"),
    (4, CHAT, 1.0, False),
    (5, TEXT, 0.5, True),
    (6, CHAT, 2.0, "never"),
    (7, CODE, 1.0, False),
    (8, CHAT, 0.5, True),
]


@pytest.mark.parametrize("k,prompt,length_penalty,early_stopping", CASES)
def test_beam_search_is_transformers_beam_search(llm, hf, k, prompt, length_penalty, early_stopping):
    ids = llm.prompt_token_ids(prompt)
    out = llm.beam_search(prompt, k, max_tokens=20, length_penalty=length_penalty, early_stopping=early_stopping)
    theirs = hf_beams(hf, llm, ids, k, 20, length_penalty=length_penalty, early_stopping=early_stopping)
    assert_same_hypotheses(out.samples, theirs)
    assert [s.index for s in out.samples] == list(range(k))
    assert all(a.score >= b.score for a, b in zip(out.samples, out.samples[1:]))
    for s in out.samples:  # the scores are what they say: sum of the model's log-probs / length ** penalty
        assert s.score == pytest.approx(sum(s.logprobs) / len(s.token_ids) ** length_penalty, rel=1e-4, abs=1e-5)
        assert s.finish_reason == ("stop" if s.token_ids[-1] in llm.eos_token_ids else "length")


def test_some_beams_end_by_eos(llm):
    """The chat cases above really exercise finished hypotheses (not only max_tokens)."""
    out = llm.beam_search(CHAT, 4, max_tokens=20)
    assert any(s.finish_reason == "stop" for s in out.samples)


def test_min_tokens_is_transformers_min_new_tokens(llm, hf):
    ids = llm.prompt_token_ids(CHAT)
    out = llm.beam_search(CHAT, 4, max_tokens=16, min_tokens=6)
    assert_same_hypotheses(out.samples, hf_beams(hf, llm, ids, 4, 16, min_new_tokens=6))
    assert all(len(s.token_ids) > 6 for s in out.samples)


def test_n_returns_the_best_hypotheses(llm):
    full = llm.beam_search(CODE, 6, max_tokens=12)
    two = llm.beam_search(CODE, 6, n=2, max_tokens=12)
    assert [s.token_ids for s in two.samples] == [s.token_ids for s in full.samples[:2]]
    one = llm.generate([{"prompt": CODE, "beam_width": 6, "max_tokens": 12}])[0]
    assert [s.token_ids for s in one.samples] == [full.samples[0].token_ids]


def hf_logprobs(hf):
    def logprobs_of(token_lists):
        with torch.no_grad():
            rows = [hf(torch.tensor([ids])).logits[0, -1].float() for ids in token_lists]
        return torch.log_softmax(torch.stack(rows), dim=-1)
    return logprobs_of


def reference(llm, hf, prompt, **options):
    params = SamplingOptions(**options).params()
    ids = llm.prompt_token_ids(prompt)
    return beam_search_reference(hf_logprobs(hf), ids, params, stop_token_set(params, llm.eos_token_ids),
                                 llm.decode)


def test_reference_is_transformers_beam_search(llm, hf):
    """The slow reference (no KV cache, lists) agrees with transformers where transformers has the
    search, so it can judge diverse beam search, which transformers 5 no longer ships."""
    ids = llm.prompt_token_ids(CHAT)
    ref = reference(llm, hf, CHAT, beam_width=4, n=4, max_tokens=12, length_penalty=0.5)
    assert_same_hypotheses(ref, hf_beams(hf, llm, ids, 4, 12, length_penalty=0.5))


@pytest.mark.parametrize("k,groups,penalty,prompt", [(4, 2, 0.5, CODE), (6, 3, 1.5, CHAT), (4, 4, 3.0, TEXT)])
def test_diverse_beam_search_is_the_reference(llm, hf, k, groups, penalty, prompt):
    options = dict(beam_width=k, n=k, max_tokens=10, num_beam_groups=groups, diversity_penalty=penalty)
    ref = reference(llm, hf, prompt, **options)
    out = llm.beam_search(prompt, k, max_tokens=10, num_beam_groups=groups, diversity_penalty=penalty)
    assert_same_hypotheses(out.samples, [(h.token_ids, h.score) for h in ref])
    plain = llm.beam_search(prompt, k, max_tokens=10)
    assert [s.token_ids for s in out.samples] != [s.token_ids for s in plain.samples]  # the penalty acts


def test_bifurcated_equals_standard_and_blocks_are_shared(llm):
    results = {}
    for path in ("bifurcated", "standard"):
        engine = llm.engine(shared_attention=path, prefix_cache=False)
        params = SamplingOptions(beam_width=8, n=8, max_tokens=40, early_stopping="never").params()
        req = engine.add_request(llm.prompt_token_ids(CODE * 6), params)
        bs = engine.block_size
        peak = 0
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
            if req.running:
                peak = max(peak, engine.blocks_in_use())
                own = sum(len(seq.block_table) for seq in req.running)
                assert engine.blocks_in_use() < own  # beams list blocks they share
        assert engine.blocks_in_use() == 0  # nothing leaked
        prompt_blocks = -(-len(req.prompt_ids) // bs)
        assert peak < prompt_blocks + 8 * -(-(len(req.prompt_ids) % bs + 40) // bs) + 8
        if path == "bifurcated":
            assert engine.metrics.shared_reads > 0
        results[path] = req.output
    a, b = results["bifurcated"], results["standard"]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        assert x.score == pytest.approx(y.score, rel=1e-5, abs=1e-6)


def test_beams_batched_with_sampling_requests(llm):
    alone_beam = llm.beam_search(TEXT, 4, max_tokens=16)
    alone_other = llm.beam_search(CHAT, 3, max_tokens=12, length_penalty=0.5)
    alone_sample = llm.sample(CODE, n=4, max_tokens=16, temperature=0.8, seed=3)
    outs = llm.generate([
        {"prompt": TEXT, "beam_width": 4, "n": 4, "max_tokens": 16},
        {"prompt": CODE, "n": 4, "max_tokens": 16, "temperature": 0.8, "seed": 3},
        {"prompt": CHAT, "beam_width": 3, "n": 3, "max_tokens": 12, "length_penalty": 0.5},
    ], prefix_cache=False)
    assert [s.token_ids for s in outs[0].samples] == [s.token_ids for s in alone_beam.samples]
    assert [s.token_ids for s in outs[1].samples] == [s.token_ids for s in alone_sample.samples]
    assert [s.token_ids for s in outs[2].samples] == [s.token_ids for s in alone_other.samples]


def test_memory_pressure_gives_the_same_beams(llm):
    """A pool too small for every request's beams at once: beams are preempted (whole beam
    searches, or their forks recomputed) and the hypotheses do not change; nothing leaks."""
    want = [llm.beam_search(p, 4, max_tokens=24, early_stopping="never") for p in (CODE, TEXT)]
    engine = llm.engine(num_blocks=34, block_size=4, prefix_cache=True)
    reqs = [engine.add_request(llm.prompt_token_ids(p), SamplingOptions(
        beam_width=4, n=4, max_tokens=24, early_stopping="never").params()) for p in (CODE, TEXT)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.metrics.preempted_samples + engine.metrics.preempted_requests > 0
    for req, w in zip(reqs, want):
        assert req.error is None
        assert [s.token_ids for s in req.output.samples] == [s.token_ids for s in w.samples]
    engine.clear_prefix_cache()
    assert engine.blocks_in_use() == 0


def test_stop_strings_end_hypotheses(llm):
    out = llm.beam_search(CODE, 4, max_tokens=24, stop=["\n"])
    for s in out.samples:
        assert "\n" not in s.text
        if s.finish_reason == "stop":
            assert s.stop_reason == "\n"
    assert any(s.finish_reason == "stop" for s in out.samples)


def test_cancel_returns_what_the_search_has(llm):
    engine = llm.engine()
    req = engine.add_request(llm.prompt_token_ids(CODE), SamplingOptions(beam_width=4, n=4, max_tokens=64,
                                                                        early_stopping="never").params())
    for _ in range(5):
        engine.step()
    engine.abort(req.request_id)
    assert req.output is not None and len(req.output.samples) == 4
    assert all(s.finish_reason in ("cancelled", "stop", "length") for s in req.output.samples)
    assert engine.blocks_in_use() - engine.radix.num_evictable_blocks == 0


@pytest.mark.parametrize("options,match", [
    (dict(beam_width=4, temperature=0.7), "deterministic"),
    (dict(beam_width=4, top_p=0.9), "deterministic"),
    (dict(beam_width=2, n=3), "n must be <= beam_width"),
    (dict(beam_width=4, num_beam_groups=3), "num_beam_groups"),
    (dict(beam_width=4, diversity_penalty=1.0), "diversity_penalty"),
    (dict(beam_width=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=-1), "beam_width"),
    (dict(beam_width=2, regex="[a-z]+"), "constrained beam search"),
    (dict(beam_width=2, top_logprobs=2), "top_logprobs"),
    (dict(beam_width=2, time_budget_s=1.0), "time_budget_s"),
    (dict(length_penalty=0.5), "beam search only"),
    (dict(num_beam_groups=2), "beam search only"),
])
def test_bad_beam_options_are_refused_by_name(options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SamplingOptions(**options)


def test_engine_limits_refuse_what_cannot_run(llm):
    engine = llm.engine(max_num_seqs=4, num_blocks=64)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        engine.add_request([1, 2, 3], SamplingOptions(beam_width=8).params())
    with pytest.raises(InvalidArgumentError, match="KV blocks"):
        engine.add_request([1, 2, 3], SamplingOptions(beam_width=4, max_tokens=400).params())
    assert engine.blocks_in_use() == 0 and not engine.has_unfinished()


def test_server_beam_search_through_the_openai_client(forklm_server, llm):
    """vLLM's extension: use_beam_search with best_of beams; the n best hypotheses come back."""
    import openai

    client = forklm_server.client()
    model = client.models.list().data[0].id
    want = llm.beam_search(CODE, 4, n=2, max_tokens=12, length_penalty=0.5)
    r = client.completions.create(model=model, prompt=CODE, n=2, max_tokens=12,
                                  extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5})
    assert [c.text for c in r.choices] == [s.text for s in want.samples]
    assert [c.model_extra["score"] for c in r.choices] == pytest.approx([s.score for s in want.samples], rel=1e-4)
    chat = client.chat.completions.create(model=model, messages=CHAT, n=3, max_tokens=12, temperature=0,
                                          extra_body={"use_beam_search": True})
    want = llm.beam_search(CHAT, 3, max_tokens=12)
    assert [c.message.content for c in chat.choices] == [s.text for s in want.samples]
    for extra, kw, param in [({"use_beam_search": True}, dict(stream=True), "use_beam_search"),
                             ({"use_beam_search": True}, dict(temperature=0.7), "temperature"),
                             ({"length_penalty": 2.0}, {}, "length_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=CODE, max_tokens=4, extra_body=extra, **kw)
        assert e.value.body["param"] == param


def test_cli_beam_width(llm):
    import json
    import subprocess
    import sys

    args = ["sample", "--beam-width", "3", "--max-tokens", "10", "--json", "--dtype", "float32", "--quantize", "none",
            CODE]
    r = subprocess.run([sys.executable, "-m", "forklm", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    want = llm.beam_search(CODE, 3, max_tokens=10)
    assert [h["token_ids"] for h in doc["hypotheses"]] == [s.token_ids for s in want.samples]
    bad = subprocess.run([sys.executable, "-m", "forklm", "sample", "--beam-width", "2", "--beam-groups", "3", CODE],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "num_beam_groups" in bad.stderr


# ---------------------------------------------------------------- a tiny random model: edges and a fuzz
def tiny_engine(**cfg):
    from conftest import tiny_llama
    from forklm.engine.engine import Engine, EngineConfig

    model = tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.float32, seed=1, max_positions=1024)
    decode = cfg.pop("decode", lambda ids: " ".join(map(str, ids)))
    return Engine(model, decode, (28,), EngineConfig(decode_kernel="torch", **cfg))


def test_stop_strings_that_many_tokens_complete_leave_fewer_beams():
    """A stop string completed by a third of the vocabulary: more than K - k candidates can stop at
    once, leaving fewer than k running beams (as transformers leaves beams it never picks)."""
    engine = tiny_engine(num_blocks=256, block_size=4, decode=lambda ids: "".join("x" if t % 3 == 0 else "y" for t in ids))
    for seed in range(12):
        prompt = [(seed * 7 + i * 3) % 29 for i in range(5 + seed % 4)]
        req = engine.add_request(prompt, SamplingOptions(beam_width=3, n=3, max_tokens=12, stop=["x"]).params())
        engine.run()
        assert req.error is None and len(req.output.samples) == 3
        engine.check_integrity()


def test_beam_search_beside_a_sample_in_a_tiny_pool_finishes():
    """Beams waiting for a preempted sibling must be able to preempt younger work (else the pool
    deadlocks: a beam step needs every beam)."""
    engine = tiny_engine(num_blocks=7, block_size=4, prefix_cache=True, max_batch_tokens=16)
    a = engine.add_request([4], SamplingOptions(beam_width=5, n=5, max_tokens=3).params())
    b = engine.add_request([23, 23, 23, 27, 24, 20, 23, 7, 20],
                           SamplingOptions(n=1, max_tokens=14, temperature=0.9, seed=38).params())
    engine.run()
    assert a.error is None and b.error is None and len(a.output.samples) == 5
    alone = tiny_engine(num_blocks=512, block_size=4)
    a2 = alone.add_request([4], SamplingOptions(beam_width=5, n=5, max_tokens=3).params())
    alone.run()
    assert [s.token_ids for s in a.output.samples] == [s.token_ids for s in a2.output.samples]


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_beams_and_samples_in_small_pools(seed):
    """Random mixes of beam searches (diverse ones too) and sampling requests in pools just large
    enough for the largest: no request stuck, every output what it is alone, every step's
    bookkeeping whole."""
    import random

    rng = random.Random(seed)
    for trial in range(8):
        specs = []
        for _ in range(rng.randint(2, 4)):
            p = [rng.randrange(28) for _ in range(rng.randint(1, 11))]
            if rng.random() < 0.75:
                k = rng.randint(2, 6)
                o = dict(beam_width=k, n=k, max_tokens=rng.randint(3, 14), early_stopping=rng.choice([False, True, "never"]))
                if k % 2 == 0 and rng.random() < 0.3:
                    o.update(num_beam_groups=2, diversity_penalty=0.7)
            else:
                o = dict(n=rng.randint(1, 4), max_tokens=rng.randint(3, 14), temperature=0.9, seed=rng.randrange(100))
            specs.append((p, o))
        bs = rng.choice([1, 2, 4])
        alone = []
        for p, o in specs:
            engine = tiny_engine(num_blocks=512, block_size=bs, prefix_cache=False)
            r = engine.add_request(p, SamplingOptions(**o).params())
            engine.run()
            alone.append([s.token_ids for s in r.output.samples])
        need = max(-(-len(p) // bs) + max(o.get("beam_width", 0), 1) * -(-(len(p) % bs + o["max_tokens"]) // bs)
                   for p, o in specs)
        engine = tiny_engine(num_blocks=need + rng.randint(0, 1), block_size=bs, prefix_cache=rng.random() < 0.5,
                             max_num_seqs=rng.choice([6, 7, 9, 256]), max_batch_tokens=rng.choice([8, 16, 64, 2048]))
        reqs = [engine.add_request(p, SamplingOptions(**o).params()) for p, o in specs]
        steps = 0
        while engine.has_unfinished():
            before = engine.metrics.steps
            engine.step()
            engine.check_integrity()
            assert engine.metrics.steps > before, f"trial {trial}: stuck"
            steps += 1
            assert steps < 5000
        for r, want in zip(reqs, alone):
            assert r.error is None
            assert [s.token_ids for s in r.output.samples] == want
        engine.clear_prefix_cache()
        assert engine.blocks_in_use() == 0


def test_a_failing_fork_fails_only_its_request(monkeypatch):
    engine = tiny_engine(num_blocks=256, block_size=4)
    real = engine.kv_manager.fork_sequence
    doomed = engine.add_request([3, 5, 7, 9, 11], SamplingOptions(beam_width=4, n=4, max_tokens=10).params())
    other = engine.add_request([2, 4, 6], SamplingOptions(n=3, max_tokens=10, temperature=0.9, seed=5).params())

    def fork(parent, state):
        if parent.request is doomed:
            raise RuntimeError("injected fork failure")
        return real(parent, state)

    monkeypatch.setattr(engine.kv_manager, "fork_sequence", fork)
    engine.run()
    assert isinstance(doomed.error, RuntimeError) and other.error is None and len(other.output.samples) == 3
    engine.check_integrity()
    engine.clear_prefix_cache()
    assert engine.blocks_in_use() == 0
