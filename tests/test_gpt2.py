"""GPT-2 and GPT-BigCode (models/gpt2.py) through the engine, on random-weight checkpoints that
transformers wrote: logits and greedy tokens == transformers', with keys and values cached (MHA /
MQA) and with EL-attention (the pool holds hidden states, queries expanded through W_K): EL ==
standard == bifurcated, beam search == transformers' beam search, the pool's bytes, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from forklm import LLM
from forklm.errors import InvalidArgumentError, UnsupportedModelError
from forklm.models.gpt2 import GPT2Model
from forklm.sampling.params import SamplingOptions

from conftest import hf_greedy

VOCAB = 300
ARCHS = ["gpt2", "gpt_bigcode"]


def build(tmp_path_factory, arch: str, **overrides):
    """A random checkpoint with weights large enough that every token depends on its context,
    and a WordLevel tokenizer over its vocabulary."""
    import transformers

    from bench.checkpoints import write_word_tokenizer

    kw = dict(vocab_size=VOCAB, n_positions=512, n_embd=64, n_layer=3, n_head=4, eos_token_id=2, bos_token_id=1)
    kw.update(overrides)
    torch.manual_seed(7)
    if arch == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw))
    else:
        hf = transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(multi_query=True, **kw))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.normal_(0, 0.5 if "wte" in name or "wpe" in name else 0.25)
            else:
                p.normal_(1.0 if "ln" in name and name.endswith("weight") else 0.0, 0.1)
    hf.eval()
    folder = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, kw["vocab_size"])
    return hf, folder


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    hf, folder = build(tmp_path_factory, request.param)
    return hf, LLM(str(folder), dtype="float32")


def prompt_ids(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("attention", ["auto", "standard", "el"])
def test_greedy_tokens_and_logprobs_are_transformers(pair, attention):
    hf, llm = pair
    assert isinstance(llm.model, GPT2Model)
    prompt = prompt_ids(1, 40)  # longer than a block: full shared blocks and a tail
    seq, lps = hf_greedy(hf, prompt, 10)
    out = llm.sample(prompt, n=3, max_tokens=10, temperature=0.0, ignore_eos=True, attention=attention)
    assert len(set(seq[len(prompt):])) > 2  # the checkpoint's tokens depend on the context
    for s in out.samples:
        assert s.token_ids == seq[len(prompt):]
        assert s.logprobs == pytest.approx(lps, rel=1e-4, abs=1e-4)


def test_el_equals_standard_and_bifurcated_when_sampling(pair):
    _, llm = pair
    prompt = prompt_ids(2, 70)
    outs = {a: llm.sample(prompt, n=6, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True, attention=a)
            for a in ("standard", "bifurcated", "el")}
    for a in ("bifurcated", "el"):
        for x, y in zip(outs[a].samples, outs["standard"].samples):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, rel=1e-4, abs=1e-5)


def test_el_pool_holds_one_hidden_state_per_token_and_layer(pair):
    _, llm = pair
    c = llm.config
    kv = llm.engine(num_blocks=8)
    el = llm.engine(num_blocks=8, kv_layout="el")
    assert el.kv.shares_values and el.kv.v is el.kv.k
    assert [tuple(t.shape) for t in el.kv.k] == [(1, el.kv.num_slots, c.hidden_size)] * c.num_layers
    per_token_kv = kv.kv.nbytes() // kv.kv.num_slots
    per_token_el = el.kv.nbytes() // el.kv.num_slots
    assert per_token_el == c.num_layers * c.hidden_size * 4
    assert per_token_kv == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    # GPT-2's multi-head cache is twice EL's; multi-query's is far smaller than EL's
    assert per_token_kv == (2 * per_token_el if c.architecture == "gpt2" else per_token_el // 2)


def test_el_cache_holds_the_attention_inputs(pair):
    """The prompt's cached hidden states are ln_1 of each layer's input, as transformers computes it."""
    hf, llm = pair
    prompt = prompt_ids(3, 20)
    engine = llm.engine(kv_layout="el", prefix_cache=False)
    req = engine.add_request(prompt, SamplingOptions(max_tokens=4, ignore_eos=True).params())
    engine.step()  # the prefill (and the first token)
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    blocks = req.prompt_blocks
    slots = [blocks[t // engine.block_size] * engine.block_size + t % engine.block_size for t in range(len(prompt))]
    for i, block in enumerate(hf.transformer.h):
        want = block.ln_1(hs[i][0])
        got = engine.kv.k[i][0, slots]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    while engine.has_unfinished():
        engine.step()


def test_beam_search_is_transformers_on_both_layouts(pair):
    hf, llm = pair
    prompt = prompt_ids(4, 30)
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, max_new_tokens=12,
                        do_sample=False, return_dict_in_generate=True, output_scores=True, eos_token_id=2,
                        pad_token_id=2, length_penalty=0.5)
    for attention in ("auto", "el"):
        out = llm.beam_search(prompt, 4, max_tokens=12, length_penalty=0.5, attention=attention)
        for i, s in enumerate(out.samples):
            gen = g.sequences[i, len(prompt):].tolist()
            assert gen[: len(s.token_ids)] == s.token_ids
            assert s.score == pytest.approx(g.sequences_scores[i].item(), rel=1e-4, abs=1e-5)


def test_el_is_refused_for_rotary_models(smollm2_f32):
    with pytest.raises(InvalidArgumentError, match="rotary"):
        smollm2_f32.engine(kv_layout="el")
    with pytest.raises(InvalidArgumentError, match="kv_layout"):
        smollm2_f32.engine(kv_layout="latent")


def test_unsupported_configs_and_tensors_are_refused_by_name(tmp_path_factory):
    _, folder = build(tmp_path_factory, "gpt2", n_layer=1)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(UnsupportedModelError, match="activation_function"):
        LLM(str(folder), dtype="float32")
    (folder / "config.json").write_text(json.dumps({**cfg, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx"):
        LLM(str(folder), dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), dtype="float32")
    llm.model.layers[0]["extra"] = None
    with pytest.raises(UnsupportedModelError, match="does not use"):
        weights = __import__("forklm.models.hf_loader", fromlist=["x"]).load_hf_weights(folder)
        weights["transformer.h.0.attn.extra.weight"] = torch.zeros(2, 2)
        GPT2Model(llm.config, weights, llm.backend)


def test_int8_weights_run_close_to_float(tmp_path_factory):
    _, folder = build(tmp_path_factory, "gpt2", n_layer=2)
    prompt = prompt_ids(8, 30)
    want = LLM(str(folder), dtype="float32").sample(prompt, max_tokens=1, temperature=0.0, top_logprobs=5)
    got = LLM(str(folder), dtype="float32", quantize="int8").sample(prompt, max_tokens=1, temperature=0.0,
                                                                    top_logprobs=5)
    assert got.samples[0].token_ids == want.samples[0].token_ids
    # per-channel int8 of these deliberately large random weights: within a quarter nat of float
    assert got.samples[0].logprobs[0] == pytest.approx(want.samples[0].logprobs[0], abs=0.25)
    assert {t for t, _ in got.samples[0].top_logprobs[0][:3]} & {t for t, _ in want.samples[0].top_logprobs[0][:3]}


def test_positions_past_the_learned_table_are_refused(tmp_path_factory):
    _, folder = build(tmp_path_factory, "gpt2", n_layer=1, n_positions=64)
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(InvalidArgumentError, match="context length"):
        llm.sample(prompt_ids(5, 60), max_tokens=8)


def test_el_chunked_prefill_and_cache_hits_recompute_prefix_keys(pair):
    """Prefill chunks over an EL pool attend over keys and values recomputed from their prefix's
    hidden states: small chunks, and a second request hitting the first one's cached prompt, give
    the one-chunk prefill's tokens and log-probs."""
    _, llm = pair
    prompt = prompt_ids(6, 90)
    want = llm.sample(prompt, n=2, max_tokens=8, temperature=0.0, ignore_eos=True, attention="standard")
    engine = llm.engine(kv_layout="el", max_batch_tokens=24)
    params = SamplingOptions(n=2, max_tokens=8, temperature=0.0, ignore_eos=True).params()
    for _ in range(2):  # the second finds the prompt in the prefix cache
        req = engine.add_request(prompt, params)
        engine.run()
        for x, y in zip(req.output.samples, want.samples):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, rel=1e-4, abs=1e-5)
    assert req.output.stats.cached_prompt_tokens > 0


# ---------------------------------------------------------------- GGUF files (llama.cpp's converter)
def mixed_types(name: str, k: int) -> str | None:
    """Every product of a layer in a different block type the block kernel runs; the table Q8_0."""
    types = {"attn_qkv": "Q8_0", "attn_output": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q5_1"}
    if name == "token_embd.weight":
        return "Q8_0"
    part = name.split(".")[2] if name.startswith("blk.") and name.endswith(".weight") else None
    return types.get(part)


@pytest.fixture(scope="module", params=ARCHS)
def gguf_pair(request, tmp_path_factory, smollm2_gguf):
    """(transformers' model, its GGUF file written by llama.cpp's convert_hf_to_gguf.py, the same
    file requantized to mixed block types), over SmolLM2's tokenizer (one the converter knows)."""
    from gguf_files import SMOLLM2_VOCAB, convert_hf_folder, requantize

    arch = request.param
    hf, folder = build(tmp_path_factory, arch, vocab_size=SMOLLM2_VOCAB, n_positions=256)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_ctx": cfg["n_positions"]}))  # the converter reads n_ctx
    f32 = convert_hf_folder(folder, folder / f"{arch}-f32.gguf", smollm2_gguf)
    return hf, f32, requantize(f32, folder / f"{arch}-mixed.gguf", mixed_types)


def test_gguf_file_is_transformers(gguf_pair):
    hf, f32, _ = gguf_pair
    llm = LLM(str(f32), dtype="float32")
    assert isinstance(llm.model, GPT2Model) and llm.config.architecture in ARCHS
    prompt = llm.prompt_token_ids("def fibonacci(n):\n    if n < 2:")
    seq, lps = hf_greedy(hf, prompt, 8)
    for attention in ("auto", "el"):
        out = llm.sample(prompt, n=2, max_tokens=8, temperature=0.0, ignore_eos=True, attention=attention)
        for s in out.samples:
            assert s.token_ids == seq[len(prompt):]
            assert s.logprobs == pytest.approx(lps, rel=1e-4, abs=1e-4)


def test_quantized_gguf_runs_its_blocks_as_stored(gguf_pair):
    """The requantized file's products run on the block kernel, no dense copies; its logits are the
    dequantized file's within the kernel's activation rounding, on both cache layouts."""
    from forklm.models.quant import BlockLinear

    _, _, mixed = gguf_pair
    fast = LLM(str(mixed), dtype="float32")
    dense = LLM(str(mixed), dtype="float32", quantize=None)
    assert fast.quantize == "gguf"
    layer = fast.model.layers[0]
    for key in ("qkv", "o", "fc", "proj"):
        assert isinstance(layer[key], BlockLinear) and layer[key].dense is None
    prompt = fast.prompt_token_ids("import numpy as np\nx = np.")
    want = dense.sample(prompt, n=2, max_tokens=6, temperature=0.0, ignore_eos=True)
    for attention in ("auto", "el"):
        got = fast.sample(prompt, n=2, max_tokens=6, temperature=0.0, ignore_eos=True, attention=attention)
        a, b = got.samples[0], want.samples[0]
        assert a.token_ids[0] == b.token_ids[0]
        assert a.logprobs[0] == pytest.approx(b.logprobs[0], rel=0.05, abs=0.05)


def test_info_describes_gpt2_and_its_el_cache(pair):
    from forklm.info import report

    _, llm = pair
    doc = report(llm)["model"]
    assert doc["architecture"] == llm.config.architecture
    assert "EL-attention" in doc["attention"] and set(doc["layers"]) and doc["decode stack"].startswith("off")


def test_beam_search_bench_runs_every_part(tmp_path_factory, capsys):
    """bench/beam_search.py's parts on a small GPT-2 (the paths it times exist and run, the widths add
    up, transformers' hypotheses are forklm's)."""
    from bench.beam_search import against_transformers, largest_widths, run_paths

    _, folder = build(tmp_path_factory, "gpt2", n_layer=2)
    llm = LLM(str(folder), dtype="float32")
    rows = run_paths(llm, [40], [2, 3], steps=4)
    assert {(r["path"], r["k"]) for r in rows} == {(p, k) for p in ("standard", "bifurcated", "el") for k in (2, 3)}
    assert all(r["steps"] == 3 and r["median_step_s"] > 0 for r in rows)
    (w,) = largest_widths(llm, [40], 4, 2**20)
    assert w["forklm_el"] > w["forklm_kv"] > w["prompt_per_beam"] > 0
    (t,) = against_transformers(llm, folder, 24, [2], 4)
    assert t["same_hypotheses"] and t["ratio"] > 0
