"""Quantized weights (forklm/models/quant.py): every product against a slow dequantize-then-matmul
reference; GGUF blocks kept as stored equal the float loader's weights; whole models quantized."""

import pytest
import torch
from conftest import rel_err
from test_models_hf import save_random

from forklm import backend
from forklm.backend import Backend
from forklm.config import ModelConfig
from forklm.errors import InvalidArgumentError
from forklm.models import quant
from forklm.models.hf_loader import load_hf_weights
from forklm.models.llama import LlamaModel
from forklm.models.quant import (
    BlockQuantized,
    GGMLWeights,
    QuantizedLinear,
    int4_from_float,
    int8_from_float,
)
from forklm.reference.forked_attention import DecodeAttention, PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache

ROWS = [1, 7, 64, 300]


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The slow obvious product in float64."""
    return x.double() @ w.double().t()


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.01


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("T", ROWS)
def test_products_match_dequantized_reference(kind, dtype, tol, T):
    n, k = 192, 576
    w = random_weight(n, k, seed=T)
    make = int8_from_float if kind == "int8" else int4_from_float
    ql = make(w, dtype)
    x = torch.randn(T, k).to(dtype)
    ref = reference(x, ql.dequantize())
    # the kernel itself at every T, and the layer (kernel or dense copy by the rule)
    assert rel_err(ql.kernel(x), ref) < tol
    assert rel_err(ql(x), ref) < tol
    bias = torch.randn(n).to(dtype)
    assert rel_err(ql(x, bias), ref + bias.double()) < tol
    # the quantized weights are close to the float ones (what the format costs)
    assert rel_err(ql.dequantize(), w) < (0.01 if kind == "int8" else 0.12)


def test_dequantize_follows_the_documented_formulas():
    w = random_weight(128, 64, seed=1)
    q8 = int8_from_float(w, torch.float32, keep_dense=False)
    assert q8.qweight.dtype == torch.int8 and q8.qweight.abs().max() <= 127
    assert torch.equal(q8.dequantize(), q8.qweight.float() * q8.scales.unsqueeze(1))
    q4 = int4_from_float(w, torch.float32, keep_dense=False)
    q = quant.unpack_int4(q4.qweight, 128, 64).long()
    assert q.min() >= 0 and q.max() <= 15
    scale = q4.scales[..., 0].t().repeat_interleave(32, dim=1)
    zero = q4.scales[..., 1].t().repeat_interleave(32, dim=1)
    assert torch.equal(q4.dequantize(), (q - 8) * scale + zero)
    assert q4.dense is None and q4.num_bytes() == q4.qweight.numel() + q4.scales.numel() * 4


def test_int4_kernel_formula_is_q_minus_8_times_scale_plus_zero():
    """The int4 kernel's own arithmetic, independent of forklm's quantizer."""
    g = torch.Generator().manual_seed(3)
    n, k = 128, 96
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(k // 32, n, generator=g) + 0.1, torch.randn(k // 32, n, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    x = torch.randn(5, k, generator=g)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, torch.stack([scale, zero], -1))
    w = (q - 8) * scale.t().repeat_interleave(32, 1) + zero.t().repeat_interleave(32, 1)
    assert rel_err(y, reference(x, w)) < 1e-6
    assert torch.equal(quant.unpack_int4(packed, n, k), q.to(torch.uint8))


def test_kernel_rule_by_rows():
    w = random_weight(64, 64, seed=2)
    ql = int4_from_float(w, torch.bfloat16)
    assert ql.max_rows == backend.KERNEL_MAX_ROWS["int4"]
    calls = []
    real = ql.kernel
    ql.kernel = lambda x: calls.append(x.shape[0]) or real(x)
    for T in (1, ql.max_rows, ql.max_rows + 1, 64):
        ql(torch.randn(T, 64, dtype=torch.bfloat16))
    assert calls == [1, ql.max_rows]
    head = int8_from_float(random_weight(backend.WIDE_OUT, 32, seed=0), torch.bfloat16)
    assert head.max_rows == backend.KERNEL_MAX_ROWS_WIDE["int8"]


def test_int4_shape_limits_are_named():
    with pytest.raises(InvalidArgumentError, match="in_features divisible by 32"):
        int4_from_float(torch.randn(64, 40), torch.bfloat16)
    odd = int4_from_float(random_weight(96, 64, seed=4), torch.float32)  # rows padded to 128 inside
    x = torch.randn(3, 64)
    assert odd.kernel(x).shape == (3, 96) and rel_err(odd.kernel(x), reference(x, odd.dequantize())) < 1e-5


# ----------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def smollm2_blocks(smollm2_gguf):
    from forklm.models.gguf_loader import load_gguf

    config, blocks, _ = load_gguf(smollm2_gguf, keep_quantized=True)
    _, floats, _ = load_gguf(smollm2_gguf)
    return config, blocks, floats


def test_gguf_blocks_dequantize_to_the_float_loader_bit_for_bit(smollm2_blocks):
    _, blocks, floats = smollm2_blocks
    kinds = {}
    for name, w in blocks.items():
        if isinstance(w, GGMLWeights):  # the file's bytes, q/k rows un-permuted by the recorded order
            kinds[w.kind] = kinds.get(w.kind, 0) + 1
            assert torch.equal(w.dequantize(), floats[name]), name
            assert torch.equal(quant.stored_block_quantized(w).dequantize(), floats[name]), name
        else:
            assert torch.equal(w, floats[name]), name
    assert kinds == {"q4_1": 210, "q8_0": 1}


def test_q4_1_as_int4_keeps_the_stored_values(smollm2_blocks):
    _, blocks, floats = smollm2_blocks
    name = "model.layers.3.self_attn.k_proj.weight"  # un-permuted rows
    b = quant.stored_block_quantized(blocks[name])
    exact = quant.int4_from_q4_1(b, torch.float32)
    assert torch.equal(exact.dequantize(), floats[name])  # no lossy round trip with float32 scales
    assert torch.equal(quant.unpack_int4(exact.qweight, *b.shape), b.q)
    x = torch.randn(7, b.shape[1])
    assert rel_err(exact.kernel(x), reference(x, floats[name])) < 1e-5
    bf = quant.int4_from_q4_1(b, torch.bfloat16)  # bfloat16 activations need bfloat16 scales
    assert torch.equal(quant.unpack_int4(bf.qweight, *b.shape), b.q)
    assert rel_err(bf.dequantize(), floats[name]) < 4e-3
    fused = BlockQuantized.cat([quant.stored_block_quantized(blocks["model.layers.0.mlp.gate_proj.weight"]),
                                quant.stored_block_quantized(blocks["model.layers.0.mlp.up_proj.weight"])])
    assert torch.equal(fused.dequantize(), torch.cat([floats["model.layers.0.mlp.gate_proj.weight"],
                                                      floats["model.layers.0.mlp.up_proj.weight"]]))


# ----------------------------------------------------------------------------- whole models
def model_logits(model, ids: torch.Tensor, decode_ids: torch.Tensor):
    """Logits at every prompt position (one forward of T rows), then after each decode token (T = 1)."""
    cfg = model.config
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), len(decode_ids), 1,
                          model.dtype, "cpu")
    prefill = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
    cache.fork()
    steps = []
    for t, tok in enumerate(decode_ids):
        steps.append(model.forward(tok[None], torch.tensor([len(ids) + t]), DecodeAttention(cache, "standard")))
        cache.own_len += 1
    return prefill, torch.cat(steps)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2", "llama-biases"])  # tied; q/k/v biases; every bias
@pytest.mark.parametrize("how, dtype, tol", [("int8", torch.bfloat16, 0.03), ("int4", torch.bfloat16, 0.15),
                                             ("int8", torch.float32, 0.03), ("int4", torch.float32, 0.15)])
def test_quantized_model_close_to_transformers(tmp_path, variant, how, dtype, tol):
    hf = save_random(tmp_path, variant)
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    model = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(dtype, torch.device("cpu"), quantize=how))
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    prompt, decode = ids[:34], ids[34:]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].double()
    assert isinstance(model.layers[0]["qkv"], QuantizedLinear) and isinstance(model.lm_head, QuantizedLinear)
    on_block_kernel = dtype == torch.float32 and backend.block_kernel_available()  # Q4_1 / Q8_0 blocks
    kernel_dtype = torch.float32 if on_block_kernel else torch.bfloat16
    if on_block_kernel:  # every row count on the kernel, no dense copy
        assert model.layers[0]["qkv"].dense is None and model.layers[0]["qkv"].dtype == kernel_dtype
        assert model.layers[0]["qkv"].kind == {"int4": "q4_1_r8", "int8": "q8_0_r8"}[how] and model.lm_head.kind == "q8_0_r8"
    else:
        assert model.layers[0]["qkv"].dense.dtype == dtype and model.layers[0]["qkv"].dtype == kernel_dtype
    prefill, steps = model_logits(model, prompt, decode)
    assert prefill.dtype == steps.dtype == torch.float32
    assert rel_err(prefill, ref[:34]) < tol
    assert rel_err(steps, ref[34:]) < tol
    dense = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(dtype, torch.device("cpu")))
    held = model.num_weight_bytes()
    if dtype == torch.bfloat16:  # kernels: packed weights + scales + the dense copy (a float32 dense
        assert held > dense.num_weight_bytes()  # tied model also holds its LM head transposed: not compared)
    packed = sum(sum(u.numel() * u.element_size() for u in t.kernel_tensors()) for lay in model.layers
                 for t in lay.values() if isinstance(t, QuantizedLinear))
    assert packed > 0


def test_quantized_float32_model_runs_the_kernel_on_bfloat16_activations(tmp_path):
    """A float32 model's int8 product where forklm's block kernel does not run (where it does, int8 and
    int4 are Q8_0 / Q4_1 blocks on it: test_block_gemm.py): PyTorch's kernel on activations rounded to
    bfloat16 for few rows, the float32 dense copy of the same weights above; both multiply the same
    dequantized weights."""
    save_random(tmp_path, "llama-mha")
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    without_block_kernel = Backend.exact(torch.float32, torch.device("cpu"), "int8")
    without_block_kernel.block_kernel = False
    model = LlamaModel(cfg, load_hf_weights(tmp_path), without_block_kernel)
    w = load_hf_weights(tmp_path)["model.layers.1.mlp.down_proj.weight"]
    held = model.layers[1]["down"]
    expect = int8_from_float(w, torch.bfloat16, keep_dense=False).dequantize()  # bfloat16 scales
    assert torch.equal(held.dequantize(), expect) and torch.equal(held.dense, expect)
    x = torch.randn(held.max_rows + 1, w.shape[1], generator=torch.Generator().manual_seed(3))
    wide = held(x)  # dense float32 rows
    assert wide.dtype == torch.float32 and rel_err(wide, x.double() @ expect.double().t()) < 1e-6
    for T in (1, held.max_rows):
        y = held(x[:T])  # the kernel: activations rounded to bfloat16, the product widened to float32
        ref = x[:T].bfloat16().double() @ expect.double().t()
        assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-2


def test_bad_quantize_values_are_named(tmp_path):
    from forklm import LLM

    for bad in ("int3", "q4", 4, True):
        with pytest.raises(InvalidArgumentError, match="quantize must be"):
            LLM("random:smollm2-135m", dtype="bfloat16", device="cpu", quantize=bad)
    with pytest.raises(InvalidArgumentError, match="give a .gguf model"):
        LLM("random:smollm2-135m", dtype="bfloat16", device="cpu", quantize="gguf")
    with pytest.raises(InvalidArgumentError, match="cpu' only"):
        backend.resolve_quantize("int4", torch.bfloat16, torch.device("cuda"))
    assert backend.resolve_quantize("auto", torch.bfloat16, torch.device("cuda")) is None
    assert backend.resolve_quantize("auto", torch.float32, torch.device("cpu"), True) == "gguf"
    assert backend.resolve_quantize("auto", torch.float32, torch.device("cpu"), False) is None
    assert backend.resolve_quantize("auto", torch.bfloat16, torch.device("cpu"), True) == "gguf"
    assert backend.resolve_quantize("auto", torch.bfloat16, torch.device("cpu"), False) is None
    assert backend.resolve_quantize("none", torch.bfloat16, torch.device("cpu")) is None


@pytest.mark.parametrize("how", ["int8", "int4"])
def test_random_model_quantized_samples(how):
    from forklm import LLM

    llm = LLM("random:smollm2-135m", dtype="bfloat16", device="cpu", quantize=how)
    assert llm.quantize == how and isinstance(llm.model.lm_head, QuantizedLinear)
    assert llm.model.layers[0]["gate_up"].kind == how and llm.model.lm_head.kind == "int8"  # head: int8 (head_format)
    assert llm.model.embed is llm.model.lm_head.dense  # tied: the table is the head's weights
    out = llm.sample([1, 2, 3, 4], n=3, max_tokens=6, seed=0, temperature=0.8)
    again = llm.sample([1, 2, 3, 4], n=3, max_tokens=6, seed=0, temperature=0.8)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in again.samples]
    assert all(len(s.token_ids) == 6 for s in out.samples)


def test_smollm2_gguf_as_stored(smollm2_gguf, smollm2_f32):
    from forklm import LLM

    llm = LLM("smollm2-135m", dtype="bfloat16", device="cpu", quantize="auto")
    assert llm.quantize == "gguf"
    m = llm.model  # a bfloat16 model: the same blocks and kernels, activations widened for them
    assert m.layers[0]["qkv"].kind == "q4_1" and m.lm_head.kind == "q8_0" and m.lm_head.dense is None
    ids = torch.tensor(smollm2_f32.tokenizer.encode("The capital of France is Paris. The capital of Germany is"))
    ref_prefill, ref_steps = model_logits(smollm2_f32.model, ids[:-4], ids[-4:])
    prefill, steps = model_logits(m, ids[:-4], ids[-4:])
    assert rel_err(prefill, ref_prefill) < 0.08
    assert rel_err(steps, ref_steps) < 0.08
    f32_gguf = LLM("smollm2-135m", dtype="float32", device="cpu", quantize="auto")
    assert f32_gguf.quantize == "gguf"  # float32 models too (forklm's block kernel on AVX2 CPUs: test_block_gemm.py)
    held, ref = f32_gguf.model.layers[5]["gate_up"], smollm2_f32.model.layers[5]["gate_up"]
    ref = ref.t() if smollm2_f32.model.weight_layout == "in_out" else ref
    assert torch.equal(held.dequantize(), ref)  # the file's blocks, exactly
    prefill, steps = model_logits(f32_gguf.model, ids[:-4], ids[-4:])
    assert rel_err(prefill, ref_prefill) < 0.08 and rel_err(steps, ref_steps) < 0.08


def test_cli_quantize_flag(capsys):
    from bench.cli import build_parser as bench_parser
    from forklm.cli import build_parser, main

    assert main(["sample", "--quantize", "int3", "hello"]) == 2
    assert "quantize must be" in capsys.readouterr().err
    parser = build_parser()
    for argv in (["sample", "--quantize", "int4", "x"], ["serve", "--quantize", "int8"]):
        assert parser.parse_args(argv).quantize == argv[2]
    for argv in (["sweep", "--quantize", "gguf"], ["serve", "--quantize", "none"]):  # the benchmarks' (python -m bench)
        assert bench_parser().parse_args(argv).quantize == argv[2]


def test_step_weight_bytes_counts_what_a_step_reads(tmp_path):
    """The benchmark's floor: packed weights and scales for steps the kernels run, dense copies above."""
    save_random(tmp_path, "llama-gqa")
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    model = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.bfloat16, torch.device("cpu"), "int4"))
    mats = [t for lay in model.layers for t in lay.values() if isinstance(t, QuantizedLinear)] + [model.lm_head]
    small = {id(t): t for t in mats}.values()
    rest = model.norm.numel() * 2 + sum(t.numel() * 2 for lay in model.layers for t in lay.values()
                                        if isinstance(t, torch.Tensor))
    packed = sum(t.qweight.numel() * t.qweight.element_size() + t.scales.numel() * 2 for t in small)
    dense = sum(t.dense.numel() * 2 for t in small)
    assert model.step_weight_bytes(1) == packed + rest
    assert model.step_weight_bytes(10_000) == dense + rest
    assert model.step_weight_bytes(1) < model.step_weight_bytes(10_000) < model.num_weight_bytes() + 1
