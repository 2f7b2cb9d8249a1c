"""DeepSeek-V2/V3 through the engine: `LLM(folder)` on a random-weight checkpoint that transformers
wrote, the latents in the paged pool (one per token and layer, no separate V), absorbed decode with
the shared prompt's latents read once for all samples and heads (bifurcated) or per sample (standard):
greedy tokens == transformers', bifurcated == standard, the pool's latents == the model's."""


import pytest
import torch

from forklm import LLM
from forklm.models.deepseek import DeepseekModel
from forklm.sampling.params import SamplingOptions

from conftest import hf_greedy, rel_err
from test_deepseek import SMALL, DenseLatentAttention, build

VOCAB = SMALL["vocab_size"]


def engine_folder(tmp_path_factory, variant: str):
    """The variant's checkpoint folder with a WordLevel tokenizer over its vocabulary (the tests run
    samples to max_tokens: ignore_eos)."""
    from bench.checkpoints import write_word_tokenizer

    hf, folder = build(tmp_path_factory, variant)
    if not (folder / "tokenizer.json").exists():
        write_word_tokenizer(folder, VOCAB)
    return hf, folder


def prompt_ids(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", ["v2-q-group", "v3-qlora"])
def test_engine_greedy_matches_transformers(tmp_path_factory, variant):
    hf, folder = engine_folder(tmp_path_factory, variant)
    llm = LLM(str(folder), dtype="float32")
    assert isinstance(llm.model, DeepseekModel)
    prompt = prompt_ids(4, 40)  # longer than a block: full shared blocks and a tail
    seq, _ = hf_greedy(hf, prompt, 8)
    out = llm.sample(prompt, n=3, max_tokens=8, temperature=0.0, ignore_eos=True)
    for s in out.samples:
        assert s.token_ids == seq[len(prompt):]


@pytest.mark.parametrize("variant", ["v2-yarn", "v3-q-half"])
@pytest.mark.parametrize("kernel", ["cpu", "torch"])
def test_bifurcated_equals_standard_on_the_latent_pool(tmp_path_factory, variant, kernel):
    """The C++ attention and PyTorch's products, the prompt's latents read once for all samples
    and heads or once per sample: the same tokens, log-probs within float32 rounding."""
    _, folder = engine_folder(tmp_path_factory, variant)
    llm = LLM(str(folder), dtype="float32")
    assert llm.backend.decode_kernel == "cpu"  # Dk = 48 on these checkpoints: the C++ attention runs them
    prompt = prompt_ids(5, 70)
    req = dict(prompt=prompt, n=6, max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    a, = llm.generate([req], shared_attention="bifurcated", decode_kernel=kernel)
    b, = llm.generate([req], shared_attention="standard", decode_kernel=kernel)
    assert a.stats.path_steps.get("bifurcated", 0) > 0 and b.stats.path_steps.get("standard", 0) > 0
    for x, y in zip(a.samples, b.samples):
        assert x.token_ids == y.token_ids
        assert rel_err(torch.tensor(x.logprobs), torch.tensor(y.logprobs)) < 1e-4
    assert len({tuple(s.token_ids) for s in a.samples}) > 1  # the samples differ from one another


@pytest.mark.parametrize("variant", ["v2-q-group", "v3-qlora"])
def test_a_sample_does_not_depend_on_n(tmp_path_factory, variant):
    """Seeded sample i is the same whether 1, 3 or 7 are drawn (README "Reproducible sampling"): the
    same tokens; the log-probs to float32 rounding, since dense float weights run PyTorch's products,
    whose kernels change with the number of rows. (Quantized, every product is each row's own and the
    samples are equal bit for bit: tests/test_deepseek_gguf.py.)"""
    _, folder = engine_folder(tmp_path_factory, variant)
    prompt = prompt_ids(8, 37)
    llm = LLM(str(folder), dtype="float32")
    outs = [llm.sample(prompt, n=n, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True) for n in (7, 3, 1)]
    for out in outs[1:]:
        for x, y in zip(out.samples, outs[0].samples):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, rel=1e-5)


def test_pool_holds_one_latent_per_token_and_layer(tmp_path_factory):
    """The pool's tensors: [1, slots, kv_lora_rank + qk_rope_head_dim] per layer, V the same tensors;
    the prompt's slots hold the latents the model computes (against the dense oracle's)."""
    _, folder = engine_folder(tmp_path_factory, "v3-qlora")
    llm = LLM(str(folder), dtype="float32")
    engine = llm.engine()
    c = llm.model.config
    assert engine.kv.v is engine.kv.k and engine.kv.shares_values
    assert tuple(engine.kv.k[0].shape) == (1, engine.kv.num_slots, c.kv_lora_rank + c.qk_rope_head_dim)
    assert c.kv_bytes_per_token(4) == c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert engine.kv.nbytes() == c.num_layers * engine.kv.num_slots * c.latent_dim * 4
    prompt = prompt_ids(6, 33)
    oracle = DenseLatentAttention()
    llm.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), oracle)
    # a fresh engine's first request takes the pool's lowest blocks: the prompt's slots are 0..32
    state = engine.add_request(prompt, SamplingOptions(n=1, max_tokens=2, temperature=0.0, ignore_eos=True).params())
    engine.run()
    assert state.error is None and len(state.output.samples[0].token_ids) == 2
    for layer in range(c.num_layers):
        cached = engine.kv.k[layer][0, : len(prompt)]
        assert rel_err(cached, oracle.cached(layer)) < 1e-4


def test_info_describes_the_latent_attention(tmp_path_factory):
    from forklm.info import model_report

    _, folder = engine_folder(tmp_path_factory, "v2-q-group")
    report = model_report(LLM(str(folder), dtype="float32"))
    assert report["architecture"] == "deepseek_v2" and "latent" in report["attention"]
    assert "32 + 16 per token" in report["attention"]


def test_mla_attention_bench_runs_every_path():
    """bench/mla_attention.py's timing function on a small grid (the paths it times exist and run)."""
    from bench.mla_attention import largest_n, step_ms

    for kernel in ("cpu", "torch"):
        for kind in ("latent", "expanded"):
            for path in ("bifurcated", "standard"):
                assert step_ms(kind, path, kernel, n=3, m_c=64, own=5, reps=1) > 0
    assert largest_n(1000, 10, m_c=20, own=5, shared=True) == 16 and largest_n(1000, 10, 20, 5, shared=False) == 4


def test_mla_e2e_bench_runs(tmp_path_factory):
    """bench/mla_e2e.py's run on a small checkpoint: both engines generate every token."""
    from bench.mla_e2e import run

    _, folder = engine_folder(tmp_path_factory, "v2-q-group")
    row = run(folder, context=70, n=3, max_tokens=4)
    assert row["forklm_s"] > 0 and row["transformers_s"] > 0 and row["ratio"] > 0


def test_int8_experts_run_quantized_close_to_float(tmp_path_factory):
    """quantize="int8": the dense layers', attention's and every expert's products quantized (the
    kernels dense models use), kv_b kept float for the absorbed decode; close to the float model."""
    from forklm.models.quant import QuantizedLinear

    _, folder = engine_folder(tmp_path_factory, "v3-qlora")
    prompt = prompt_ids(4, 40)
    want = LLM(str(folder), dtype="float32").sample(prompt, max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", quantize="int8")
    moe = llm.model.layers[1]["mlp"]
    assert all(isinstance(e.gate_up, QuantizedLinear) and isinstance(e.down, QuantizedLinear) for e in moe.experts)
    got = llm.sample(prompt, n=2, max_tokens=3, temperature=0.0, ignore_eos=True)
    for s in got.samples:
        assert s.token_ids[0] == want.samples[0].token_ids[0]
        assert s.logprobs[0] == pytest.approx(want.samples[0].logprobs[0], abs=0.1)


@pytest.mark.parametrize("variant", ["v2-q-group", "v3-qlora"])
def test_speculation_and_prefix_cache_on_the_latent_pool(tmp_path_factory, variant):
    """The engine's other parts on a DeepSeek model: n-gram speculation (drafted tokens verified as
    multi-token extends over the latent pool) gives the plain run's tokens; a second request for the
    same prompt finds its latents in the radix cache and gives the same samples."""
    _, folder = engine_folder(tmp_path_factory, variant)
    llm = LLM(str(folder), dtype="float32")
    base = prompt_ids(9, 30)
    prompt = base + base[:12]  # a repeat in the prompt, for the n-gram drafter to find
    plain = llm.sample(prompt, n=3, max_tokens=16, temperature=0.0, ignore_eos=True)
    spec_engine = llm.engine(speculative={"method": "ngram", "num_draft_tokens": 4})
    state = spec_engine.add_request(prompt, SamplingOptions(n=3, max_tokens=16, temperature=0.0, ignore_eos=True).params())
    spec_engine.run()
    assert [s.token_ids for s in state.output.samples] == [s.token_ids for s in plain.samples]
    for x, y in zip(state.output.samples, plain.samples):
        assert x.logprobs == pytest.approx(y.logprobs, rel=1e-4, abs=1e-5)
    assert spec_engine.metrics.speculative.draft_tokens > 0 and spec_engine.metrics.speculative.accepted_tokens > 0
    req = dict(prompt=prompt, n=2, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    first, = llm.generate([req])
    again, = llm.generate([req])
    assert again.stats.cached_prompt_tokens >= 16
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in first.samples]
