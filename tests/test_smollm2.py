"""The default model (SmolLM2-135M GGUF) end to end, against transformers loading the same file."""

import pytest
import torch

from forklm.reference.forked_attention import DecodeAttention, PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache

from conftest import rel_err

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def llm(smollm2_f32):
    return smollm2_f32


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


def test_prompt_and_decode_logits_match_transformers(llm, hf):
    ids = llm.tokenizer.encode(PROMPT)
    model, cfg = llm.model, llm.config
    steps = 32
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), steps, 1, model.dtype, "cpu")
    prefill = model.forward(torch.tensor(ids), torch.arange(len(ids)), PrefillAttention(cache))
    cache.fork()
    tok = prefill[-1].argmax()
    decoded, logits = [], []
    for t in range(steps):
        decoded.append(int(tok))
        lg = model.forward(tok[None], torch.tensor([len(ids) + t]), DecodeAttention(cache, "bifurcated"))
        cache.own_len += 1
        logits.append(lg[0])
        tok = lg[0].argmax()
    with torch.no_grad():
        ref = hf(torch.tensor([ids + decoded])).logits[0]
    assert rel_err(prefill, ref[: len(ids)]) < 1e-4
    assert rel_err(torch.stack(logits), ref[len(ids):]) < 1e-4


@pytest.mark.parametrize("attention", ["standard", "bifurcated"])
def test_greedy_64_tokens_match_transformers(llm, hf, attention):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.sample(ids, n=3, max_tokens=64, temperature=0, ignore_eos=True, attention=attention)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64)[0, len(ids):]
    for s in out.samples:  # greedy with n > 1: n equal samples, each equal to transformers'
        assert s.token_ids == ref.tolist()
        assert s.finish_reason == "length"


def test_reported_logprobs_are_the_models(llm, hf):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.sample(ids, n=4, max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    for s in out.samples:
        with torch.no_grad():
            logits = hf(torch.tensor([ids + s.token_ids])).logits[0, len(ids) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=2e-4)
        assert s.cumulative_logprob == pytest.approx(float(ref.sum()), abs=2e-3)
        assert s.mean_logprob == pytest.approx(s.cumulative_logprob / len(s.token_ids))


def test_seeded_runs_repeat_and_samples_do_not_depend_on_n_or_path(llm):
    kw = dict(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = llm.sample(PROMPT, n=4, attention="bifurcated", **kw)
    b = llm.sample(PROMPT, n=4, attention="bifurcated", **kw)
    c = llm.sample(PROMPT, n=16, attention="standard", **kw)
    # the path asked for is the path taken (the CPU kernel once read shared segments either way)
    assert set(a.stats.path_steps) == {"bifurcated"} and set(c.stats.path_steps) == {"standard"}
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in c.samples[:4]]
    assert len({tuple(s.token_ids) for s in c.samples}) > 4  # the samples really differ
    d = llm.sample(PROMPT, n=4, **{**kw, "seed": 99})
    assert [s.token_ids for s in d.samples] != [s.token_ids for s in a.samples]


def test_stop_strings_cut_exactly(llm):
    out = llm.sample(PROMPT, n=6, max_tokens=40, temperature=0.7, seed=5, stop=["\n"], ignore_eos=True)
    for s in out.samples:
        full = llm.tokenizer.decode(s.token_ids)
        if s.finish_reason == "stop":
            assert s.stop_reason == "\n" and "\n" not in s.text
            assert full.startswith(s.text) and full[len(s.text)] == "\n"
            assert "\n" not in llm.tokenizer.decode(s.token_ids[:-1])  # it stopped at the first one
        else:
            assert "\n" not in full and len(s.token_ids) == 40
    assert any(s.finish_reason == "stop" for s in out.samples)


def test_eos_min_tokens_and_finished_samples_leave(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    out = llm.sample(chat, n=8, max_tokens=48, temperature=0.7, seed=0)
    stopped = [s for s in out.samples if s.finish_reason == "stop"]
    assert stopped, "a short chat answer should end with the end-of-turn token"
    for s in stopped:
        assert s.stop_reason in llm.eos_token_ids and s.token_ids[-1] == s.stop_reason
    # Finished samples leave the batch: fewer tokens generated than n * steps.
    assert out.stats.generated_tokens == sum(len(s.token_ids) for s in out.samples)
    longest = max(len(s.token_ids) for s in out.samples)
    assert out.stats.steps <= longest - 1
    held = llm.sample(chat, n=4, max_tokens=20, min_tokens=20, temperature=0.7, seed=0)
    assert all(len(s.token_ids) == 20 and s.finish_reason == "length" for s in held.samples)


def test_ranked_deduplicates_by_text(llm):
    out = llm.sample(PROMPT, n=8, max_tokens=6, temperature=0, ignore_eos=True)
    ranked = out.ranked(k=3)
    assert len(ranked) == 1  # greedy: eight equal samples, one distinct text
    out = llm.sample(PROMPT, n=8, max_tokens=6, temperature=1.2, seed=1, ignore_eos=True)
    ranked = out.ranked()
    assert len({s.text for s in ranked}) == len(ranked)
    assert [s.mean_logprob for s in ranked] == sorted((s.mean_logprob for s in ranked), reverse=True)
    assert out.stats.prefill_s > 0 and out.stats.decode_s > 0 and out.stats.tokens_per_s > 0
