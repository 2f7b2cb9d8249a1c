"""Speculative sampling with a draft model (forklm/speculative/draft_model.py).

Greedy drafts under the engine fuzz test's scenarios (tests/test_engine_fuzz.py: random block
sizes, pools just above a request's minimum so samples and requests are preempted, chunked
prefill, both schedules, every shared-attention mode, prefix cache on/off, random cancels), on
the tiny float64 Llama, with two drafts:
- the target itself: with every request greedy, every draft token must be accepted, which checks
  the draft's twin KV (prompt mirrored as it is prefilled, catch-up of the lag, partial prompt
  blocks copied with the target's, prefix-cache hits, recomputes after preemption);
- the target's first layer only (same embedding and head): many rejections, any sampling params.
Every request gives exactly the tokens, log-probs, finish reasons and texts of the reference
without speculation; integrity after every step, no block left, and every token sequence
inserted into the radix cache is a prefix of a prompt plus a reference sample.

Plus: a draft model whose tokenizer differs is refused (InvalidArgumentError naming draft_model),
and a sampled draft (draft_temperature > 0, modified rejection sampling) emits tokens distributed
as the target's (chi-squared on the joint of a sample's first two tokens, the second drafted).
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter

import pytest
import torch
from conftest import tiny_llama
from test_engine_fuzz import EOS, HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, V, decode, describe, draw_scenario
from test_engine_fuzz import tiny_model
from test_speculative_fuzz import run_checked

from forklm.cache.radix_cache import RadixCache
from forklm.engine.engine import Engine, EngineConfig
from forklm.errors import InvalidArgumentError
from forklm.sampling.params import SamplingParams
from forklm.speculative.config import SpeculativeConfig

SEEDS = range(70)


@functools.lru_cache(maxsize=None)
def first_layer_model():
    """The target's first layer, embedding and head (the same generator draws them first)."""
    return tiny_llama(V, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1, torch.float64, seed=1234)


def draft_scenario(seed: int, which: str) -> dict:
    sc = draw_scenario(seed)
    rnd = random.Random(30_000 + seed)
    k = rnd.choice(["auto", 1, 2, 3, 5, 8])
    if which == "self":  # greedy requests: a target drafting for itself is always right
        for r in sc["requests"]:
            r["params"]["temperature"] = 0.0
            r["params"].pop("min_tokens", None)  # (its stop-id ban is the target's draw's, not the draft's)
        model = tiny_model()
    else:
        model = first_layer_model()
    sc["engine"]["speculative"] = {"method": "draft", "draft_model": model, "num_draft_tokens": k}
    return sc


@pytest.fixture
def recorded(monkeypatch):
    inserted: list[tuple[int, ...]] = []
    real_insert = RadixCache.insert

    def recording_insert(self, tokens, blocks):
        inserted.append(tuple(tokens))
        return real_insert(self, tokens, blocks)

    monkeypatch.setattr(RadixCache, "insert", recording_insert)
    real_init = Engine.__init__
    engines: list[Engine] = []

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", keep)
    return inserted, engines


@pytest.mark.parametrize("which", ["self", "first-layer"])
def test_greedy_draft_model_fuzz(recorded, which):
    inserted, engines = recorded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cov: Counter = Counter()
    failures = []
    try:
        for seed in SEEDS:
            sc = draft_scenario(seed, which)
            try:
                m = run_checked(sc, cov, inserted, engines)
                assert m.draft_failures == 0, engines[-1].speculator.draft_error
                if which == "self":
                    assert m.accepted_tokens == m.draft_tokens, f"self-draft rejected tokens: {m}"
            except AssertionError as e:
                failures.append((seed, f"{e}\n{describe(sc)}"))
    finally:
        torch.set_num_threads(threads)
    assert not failures, f"{len(failures)} of {len(SEEDS)} failed (seeds {[s for s, _ in failures]}):\n{failures[0][1]}"
    must = ["draft_tokens", "accepted_tokens", "preempted_samples", "preempted_requests", "cached_prompt_tokens",
            "cancel_running"]
    if which != "self":
        must.append("rejected_tokens")
    for what in must:
        assert cov[what] > 0, f"no scenario exercised {what}: {dict(cov)}"


def test_draft_config_is_checked():
    with pytest.raises(InvalidArgumentError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(InvalidArgumentError, match="draft_model"):
        SpeculativeConfig(method="ngram", draft_model="smollm2-135m")
    with pytest.raises(InvalidArgumentError, match="draft_temperature"):
        SpeculativeConfig(method="draft", draft_model="x", draft_temperature=-1)
    with pytest.raises(InvalidArgumentError, match="draft_top_p"):
        SpeculativeConfig(method="draft", draft_model="x", draft_top_p=0)
    other_vocab = tiny_llama(V + 1, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1, torch.float64, seed=1)
    with pytest.raises(InvalidArgumentError, match="draft_model.*vocabulary"):
        Engine(tiny_model(), decode, (EOS,), EngineConfig(num_blocks=8, speculative={"method": "draft", "draft_model": other_vocab}))
    f32 = tiny_llama(V, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, 1, torch.float32, seed=1)
    with pytest.raises(InvalidArgumentError, match="draft_model"):
        Engine(tiny_model(), decode, (EOS,), EngineConfig(num_blocks=8, speculative={"method": "draft", "draft_model": f32}))


def _hf_folder(path, vocab: dict[str, int], seed: int):
    from test_models_hf import save_random
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    save_random(path, "llama-gqa", seed=seed)
    backend = Backend(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    return str(path)


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    """(d) Same vocabulary size, other ids: refused before any engine is built; the same tokenizer runs."""
    from forklm import LLM

    words = {f"w{i}": i for i in range(320)}
    swapped = dict(words, w1=2, w2=1)
    target = _hf_folder(tmp_path / "target", words, seed=0)
    same = _hf_folder(tmp_path / "same", words, seed=1)
    other = _hf_folder(tmp_path / "other", swapped, seed=1)
    with pytest.raises(InvalidArgumentError, match="draft_model.*tokenizer differs"):
        LLM(target, dtype="float32", device="cpu", speculative={"method": "draft", "draft_model": other})
    llm = LLM(target, dtype="float32", device="cpu")
    with pytest.raises(InvalidArgumentError, match="draft_model.*tokenizer differs"):
        llm.sample("w1 w2", max_tokens=4, speculative={"method": "draft", "draft_model": other})
    assert not getattr(llm, "_engines_by_attention", {}) and getattr(llm, "_engine", None) is None
    plain = llm.sample("w1 w2 w3", n=3, max_tokens=8, seed=3, ignore_eos=True)
    spec = LLM(target, dtype="float32", device="cpu",
               speculative={"method": "draft", "draft_model": same, "num_draft_tokens": 3})
    out = spec.sample("w1 w2 w3", n=3, max_tokens=8, seed=3, ignore_eos=True)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in plain.samples]
    assert spec.default_engine().metrics.speculative.draft_tokens > 0


def test_random_draft_pairs_with_random_target():
    from forklm import LLM

    llm = LLM("random:" + _tiny_random_config(), dtype="float32", device="cpu",
              speculative={"method": "draft", "draft_model": "random:" + _tiny_random_config(), "num_draft_tokens": 2})
    out = llm.sample([1, 2, 3], n=2, max_tokens=6, seed=0, ignore_eos=True)
    plain = llm.sample([1, 2, 3], n=2, max_tokens=6, seed=0, ignore_eos=True, speculative=False)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in plain.samples]
    assert llm.default_engine().metrics.speculative.draft_tokens > 0


@functools.lru_cache(maxsize=None)
def _tiny_random_config() -> str:
    import json
    import tempfile

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, rms_norm_eps=1e-5)
    path = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(cfg, path)
    path.close()
    return path.name


def test_sampled_draft_is_distributed_as_the_target():
    """A sampled draft (draft_temperature 1, top-p 0.9) of one token per step, 3000 samples of
    one request: the joint of each sample's second token (its first decode step, which starts
    the sample and does not draft) and third (drafted, then accepted or recovered) against the
    target's exact joint, the first token summed out, by chi-squared. Seeded runs repeat."""
    torch.set_num_threads(1)
    model = tiny_model()
    prompt, n = [1, 5, 2, 8], 3000
    params = SamplingParams(n=n, max_tokens=4, seed=11, temperature=1.0, ignore_eos=True)
    spec = {"method": "draft", "draft_model": first_layer_model(), "num_draft_tokens": 1,
            "draft_temperature": 1.0, "draft_top_p": 0.9}

    def run():
        eng = Engine(model, decode, (EOS,), EngineConfig(block_size=4, num_blocks=4000, max_batch_tokens=8192,
                                                          max_num_seqs=1024, speculative=spec))
        st = eng.add_request(prompt, params)
        while eng.has_unfinished():
            eng.step()
        assert eng.blocks_in_use() == 0
        return [tuple(s.token_ids[1:3]) for s in st.output.samples], eng.metrics.speculative

    pairs, m = run()
    assert m.draft_tokens >= n * 0.9 and 0 < m.accepted_tokens < m.draft_tokens
    assert run()[0] == pairs  # reproducible with a seed
    # the exact joint: sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), from the model's logits
    first = torch.softmax(_logits(model, prompt), -1)
    expected = dict.fromkeys(((t2, t3) for t2 in range(V) for t3 in range(V)), 0.0)
    for t1 in range(V):
        second = torch.softmax(_logits(model, prompt + [t1]), -1)
        for t2 in range(V):
            third = torch.softmax(_logits(model, prompt + [t1, t2]), -1)
            for t3 in range(V):
                expected[(t2, t3)] += float(first[t1] * second[t2] * third[t3]) * n
    observed = Counter(pairs)
    cells = sorted(expected, key=lambda c: expected[c])
    chi2, dof, pool_e, pool_o = 0.0, -1, 0.0, 0
    for c in cells:  # pool the rare cells until each counted cell expects >= 5
        pool_e += expected[c]
        pool_o += observed.get(c, 0)
        if pool_e >= 5:
            chi2 += (pool_o - pool_e) ** 2 / pool_e
            dof += 1
            pool_e, pool_o = 0.0, 0
    # 99.9% quantile of chi-squared (Wilson-Hilferty)
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} over {dof} dof (limit {limit:.1f})"


def _logits(model, ids: list[int]) -> torch.Tensor:
    from forklm.reference.forked_attention import PrefillAttention
    from forklm.reference.forked_kv import ForkedKVCache

    cfg = model.config
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), 1, 1, model.dtype, "cpu")
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), PrefillAttention(cache))
    return out[-1].double()
