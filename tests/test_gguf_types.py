"""Whole models on GGUF files of every common type, kept as stored: placement (no dense copies), logits
against the exact float path of the same file, seeded samples independent of n and of the batch
around them, and the engine's speculation and constraints on a K-quant file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_err
from gguf_files import iq4_type, k_quant_type, low_bit_type, requantize, zoo_type

from forklm.kernels import block_gemm, ggml_gemm
from forklm.models import quant
from forklm.models.quant import BlockLinear, GGMLLinear

pytestmark = pytest.mark.skipif(not block_gemm.cpu_supports(), reason="the kernels need x86-64 with AVX2")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def zoo_gguf(smollm2_gguf, tmp_path_factory):
    if not ggml_gemm.available():
        pytest.fail(f"ggml's kernels did not build on an AVX2 CPU: {ggml_gemm.build_error()}")
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("gguf") / "smollm2-zoo.gguf", zoo_type)


@pytest.fixture(scope="session")
def kquant_gguf(smollm2_gguf, tmp_path_factory):
    if not ggml_gemm.available():
        pytest.fail(f"ggml's kernels did not build on an AVX2 CPU: {ggml_gemm.build_error()}")
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_m-like.gguf", k_quant_type)


@pytest.fixture(scope="session")
def zoo_llms(zoo_gguf):
    from forklm import LLM

    return LLM(str(zoo_gguf)), LLM(str(zoo_gguf), dtype="float32", quantize=None)


def test_every_type_runs_as_stored_with_no_dense_copy(zoo_gguf, zoo_llms):
    import gguf

    llm, _ = zoo_llms
    assert llm.quantize == "gguf" and llm.dtype == torch.float32
    m = llm.model
    kinds = set()
    for layer in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = layer[name]
            assert isinstance(w, (GGMLLinear, BlockLinear)) and w.dense is None, (name, w)
            kinds.update(w.stored_types)
            if all(quant.block_kernel_kind([t]) is not None for t in w.stored_types):
                # forklm's block kernel (Q4_0 / Q5_0 as Q4_1 / Q5_1 blocks, exactly; parts of different
                # layouts side by side)
                assert isinstance(w, BlockLinear), (name, w.stored_types)
            else:
                assert isinstance(w, GGMLLinear)
    assert kinds >= {"Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q8_0", "Q4_1", "F16", "BF16",
                     "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"}
    assert m.embed is None and m.lm_head.dense is None
    # weights resident once: what the model holds is about the file's tensor bytes (Q4_1 / Q8_0
    # repacked for the block kernel; norms widened to float32 are a few KB)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(zoo_gguf).tensors)
    assert m.num_weight_bytes() < 1.1 * file_bytes


def test_as_stored_logits_close_to_the_float_path_of_the_same_file(zoo_llms, smollm2_f32):
    from tests.test_quant import model_logits

    llm, ref = zoo_llms
    ids = torch.tensor(smollm2_f32.tokenizer.encode("The capital of France is Paris. The capital of Germany is"))
    ref_prefill, ref_steps = model_logits(ref.model, ids[:-4], ids[-4:])
    prefill, steps = model_logits(llm.model, ids[:-4], ids[-4:])
    # the weights are the same values; the difference is the activations' 8-bit (or f16) rounding,
    # 0.5-0.8% a product (test_ggml_gemm.py), grown over 30 layers of a model with Q2_K / Q3_K layers
    # (measured 0.064 here; the default Q4_1 file's own: < 0.06, test_block_gemm.py)
    assert rel_err(prefill, ref_prefill) < 0.1 and rel_err(steps, ref_steps) < 0.1
    assert torch.equal(llm.model.layers[3]["down"].dequantize(), ref.model.layers[3]["down"].t()
                       if ref.model.weight_layout == "in_out" else ref.model.layers[3]["down"])


# 220 tokens: 13 full blocks the samples share (read by 3 query vectors a KV head at n = 1, by 192 at n = 64)
LONG = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 12) + "def main():\n"
SEEDED = dict(max_tokens=12, temperature=0.8, top_p=0.95, seed=7)


def _first_samples(llm, n: int, prompt: str, k: int = 8) -> list[tuple[list[int], list[float]]]:
    out = llm.sample(prompt, n=n, **SEEDED)
    return [(s.token_ids, s.logprobs) for s in out.samples[:k]]


@pytest.mark.parametrize("which", ["default", "zoo"])
@pytest.mark.parametrize("prompt", ["Once upon a time", LONG])
def test_seeded_samples_do_not_depend_on_n_the_batch_or_the_cache(which, prompt, zoo_llms):
    """Sample i is the same, its log-probabilities bit for bit, for n = 1, 8, 24 and 64, with its prompt
    cached or not, prefilled in one chunk or in several, and when other requests run beside it."""
    from forklm import LLM
    from forklm.sampling.params import SamplingParams

    llm = LLM() if which == "default" else zoo_llms[0]
    llm.clear_prefix_cache()
    base = _first_samples(llm, 8, prompt)  # the prompt computed whole
    assert _first_samples(llm, 8, prompt) == base  # its blocks from the prefix cache
    assert _first_samples(llm, 1, prompt) == base[:1]
    for n in (24, 64):
        assert _first_samples(llm, n, prompt) == base, n
    llm.clear_prefix_cache()
    outs = llm.generate([
        {"prompt": prompt, "n": 8, **SEEDED},
        {"prompt": "def add(a, b):", "n": 20, "max_tokens": 9, "temperature": 1.0, "seed": 3},
        {"prompt": prompt[: len(prompt) // 2], "n": 5, "max_tokens": 4, "temperature": 0.5, "seed": 1},
    ])
    assert [(s.token_ids, s.logprobs) for s in outs[0].samples] == base
    engine = llm.engine(max_batch_tokens=40)  # the prompt prefilled in chunks of up to 40 tokens
    state = engine.add_request(llm.prompt_token_ids(prompt), SamplingParams(n=8, **SEEDED))
    engine.run()
    assert [(s.token_ids, s.logprobs) for s in state.output.samples] == base


def test_speculation_on_the_default_file_gives_the_plain_samples_bit_for_bit():
    """Drafted tokens verified as a chunk attend in the order a decode row would: with the n-gram drafter
    (point masses) the seeded samples and their log-probs are those of plain decoding, bit for bit."""
    from forklm import LLM
    from forklm.sampling.params import SamplingParams

    llm = LLM()
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 4 + "def mul(a, b):\n"
    for temperature in (0.0, 0.8):
        params = SamplingParams(n=4, max_tokens=24, temperature=temperature, seed=3)
        plain = llm.engine(speculative=None)
        spec = llm.engine(speculative={"method": "ngram", "num_draft_tokens": 3})
        want = plain.add_request(llm.prompt_token_ids(code), params)
        got = spec.add_request(llm.prompt_token_ids(code), params)
        plain.run()
        spec.run()
        assert spec.metrics.speculative.accepted_tokens > 0
        assert [(s.token_ids, s.logprobs) for s in got.output.samples] == \
            [(s.token_ids, s.logprobs) for s in want.output.samples]


def test_engine_features_on_a_k_quant_file(kquant_gguf):
    from forklm import LLM

    llm = LLM(str(kquant_gguf))
    m = llm.model
    assert {w.kind for w in (m.layers[0]["down"], m.layers[0]["gate_up"])} == {"q6_k_r8", "q5_0_r8"}  # interleaved
    plain = llm.sample("1, 2, 3, 4, 5, 6, 7, 8,", n=4, max_tokens=16, temperature=0.0)
    spec = llm.sample("1, 2, 3, 4, 5, 6, 7, 8,", n=4, max_tokens=16, temperature=0.0, speculative="ngram")
    assert [s.token_ids for s in spec.samples] == [s.token_ids for s in plain.samples]
    out = llm.sample("My phone number is", n=3, max_tokens=20, regex=r"[0-9]{3}-[0-9]{4}", seed=0)
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", s.text) for s in out.samples)
    seeded = llm.sample("Once upon a time", n=16, max_tokens=8, temperature=0.8, seed=5)
    again = llm.sample("Once upon a time", n=3, max_tokens=8, temperature=0.8, seed=5)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in seeded.samples[:3]]


@pytest.fixture(scope="session")
def low_bit_gguf(smollm2_gguf, tmp_path_factory):
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("gguf") / "smollm2-q2_k-like.gguf", low_bit_type)


@pytest.fixture(scope="session")
def iq4_gguf(smollm2_gguf, tmp_path_factory):
    return requantize(smollm2_gguf, tmp_path_factory.mktemp("gguf") / "smollm2-iq4_xs-like.gguf", iq4_type)


@pytest.mark.parametrize("case", ["q2_k+q3_k", "iq4_xs+iq4_nl"])
def test_a_low_bit_file_runs_whole_on_the_block_kernel_and_the_decode_stack(case, request):
    """Q2_K / Q3_K matrices (beside Q4_0), or IQ4_XS (beside IQ4_NL), on the block kernel's own layouts,
    every layer in the decode stack: logits close to the exact float path of the same file, the
    dequantized weights that path's bit for bit, greedy samples the same on the stack as in the layer
    loop, seeded samples independent of n."""
    from forklm import LLM
    from tests.test_quant import model_logits

    path = request.getfixturevalue("low_bit_gguf" if case == "q2_k+q3_k" else "iq4_gguf")
    down_kinds = ["q2_k", "q3_k"] if case == "q2_k+q3_k" else ["iq4_xs", "iq4_xs"]
    llm = LLM(str(path))
    ref = LLM(str(path), dtype="float32", quantize=None)
    m = llm.model
    assert [m.layers[i]["down"].kind for i in (0, 1)] == down_kinds
    assert all(isinstance(layer[name], BlockLinear) and layer[name].dense is None
               for layer in m.layers for name in ("qkv", "o", "gate_up", "down"))
    for i in (0, 1):
        want = ref.model.layers[i]["down"]
        assert torch.equal(m.layers[i]["down"].dequantize(), want.t() if ref.model.weight_layout == "in_out" else want)
    # a 2-bit model is chaotic on a short prompt (one sentence's logits part by 0.15 on this path and
    # by 0.10 on ggml's products of the same bytes, whose arithmetic is the block kernel's): 300 tokens
    # of text, where both part from the float path by 0.03 and the mean log-likelihood by 0.1-0.4%
    text = (REPO / "bench" / "data" / "shakespeare_macbeth.txt").read_text()[5000:8000]
    ids = torch.tensor(ref.tokenizer.encode(text)[:300])
    ref_prefill, ref_steps = model_logits(ref.model, ids[:-4], ids[-4:])
    prefill, steps = model_logits(m, ids[:-4], ids[-4:])
    assert rel_err(prefill, ref_prefill) < 0.06 and rel_err(steps, ref_steps) < 0.1
    nll = [float(torch.nn.functional.cross_entropy(p[:-1].float(), ids[1:-4])) for p in (prefill, ref_prefill)]
    assert abs(nll[0] - nll[1]) < 0.01 * nll[1]
    m.prepare_decode_stack()
    assert m._decode_stack is not None
    base = _first_samples(llm, 8, LONG)
    assert _first_samples(llm, 1, LONG) == base[:1] and _first_samples(llm, 24, LONG) == base
    greedy = llm.sample("def add(a, b):", n=2, max_tokens=10, temperature=0.0)
    m._decode_stack = None  # the layer loop (the stack is a pure speed-up of it)
    loop = llm.sample("def add(a, b):", n=2, max_tokens=10, temperature=0.0)
    assert [s.token_ids for s in loop.samples] == [s.token_ids for s in greedy.samples]


def test_a_type_without_a_kernel_is_refused_by_name():
    parts = [ggml_gemm.GGMLWeights(torch.zeros(4, 54, dtype=torch.uint8), "TQ1_0", 4, 256)]
    with pytest.raises(Exception, match="TQ1_0"):
        quant.stored_matrix(parts, block_kernel=True)


def test_without_ggml_a_file_of_its_types_is_refused_and_the_float_path_runs(zoo_gguf, kquant_gguf):
    """Without ggml's kernels: the Q4_K_M-like file and the zoo file (F16 / BF16 as stored too) run whole on
    the block kernel; a type only ggml runs (F32 matrices) is refused by name, the file's float path named."""
    code = (
        "import sys, torch\n"
        "from forklm import LLM\n"
        "from forklm.errors import UnsupportedModelError\n"
        "from forklm.kernels.ggml_gemm import GGMLWeights\n"
        "from forklm.models import quant\n"
        f"assert LLM({str(kquant_gguf)!r}).sample('Hello', n=2, max_tokens=3, seed=0).samples\n"
        f"llm = LLM({str(zoo_gguf)!r})\n"
        "assert llm.sample('Hello', n=2, max_tokens=3, seed=0).samples\n"
        "assert all(isinstance(l[n], quant.BlockLinear) for l in llm.model.layers for n in ('qkv', 'o', 'gate_up', 'down'))\n"
        "part = GGMLWeights(torch.zeros(4, 128, dtype=torch.uint8), 'F32', 4, 32)\n"
        "try:\n"
        "    quant.stored_matrix([part], block_kernel=True)\n"
        "    sys.exit('an F32 matrix ran without its kernels')\n"
        "except UnsupportedModelError as e:\n"
        "    assert 'F32' in str(e) and 'ggml' in str(e) and 'quantize=None' in str(e) and 'FORKLM_GGML=0' in str(e), e\n"
    )
    env = dict(os.environ, FORKLM_GGML="0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_forklm_info_names_each_weights_kernel(kquant_gguf, capsys):
    import json

    from forklm.cli import main

    assert main(["info", "--model", str(kquant_gguf), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "avx2" in doc["cpu features forklm's rules see"]
    assert doc["kernels"]["ggml dot products (every other GGUF type)"].startswith("built")
    layers = doc["model"]["layers"]
    assert any(k.startswith("down: Q6_K -> block kernel (q6_k_r8 layout") for k in layers)
    assert any(k.startswith("gate_up: Q5_0+Q5_0 -> block kernel (q5_0_r8 layout") for k in layers)
    assert any(k.startswith("qkv: Q5_0+Q5_0+Q8_0 -> block kernel (q5_0_r8+q8_0_r8 layout") for k in layers)  # mixed parts
    assert doc["model"]["decode stack"] == "on"
    assert main(["info", "--no-model"]) == 0
    assert "block kernel" in capsys.readouterr().out
