"""The decode stack (kernels/decode_stack.py: a step's layers in one C++ call) against the model's
layer loop it replaces: the same samples and log-probabilities bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import amx_tiles_expected, native_kernels_expected

from forklm.attention.paged import PagedAttention
from forklm.kernels import block_gemm as bg
from forklm.kernels import decode_stack

# skipped only where the kernels cannot run (the CPU, torch's OpenMP); on a CPU that should build
# the decode stack, a failed build fails `test_builds_here` (and the rest) instead of passing silently
pytestmark = pytest.mark.skipif(not native_kernels_expected(), reason="no AVX2 / FMA / F16C, or torch without libgomp")


def test_builds_here():
    assert decode_stack.build_error() is None


def tiny_block_model(seed: int = 7):
    """A small random Llama whose layers are Q4_1 blocks (int4 from its float weights)."""
    from conftest import tiny_llama

    return tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.float32, seed=seed, max_positions=1024, quantize="int4")


def use_stack(model, on: bool) -> None:
    model._decode_stack = decode_stack.build(model) if on else None
    model._decode_stack_checked = True


def count_stack_steps(monkeypatch) -> dict[str, int]:
    calls = {"n": 0}
    real = PagedAttention.run_layers

    def counted(self, *args):
        calls["n"] += 1
        return real(self, *args)

    monkeypatch.setattr(PagedAttention, "run_layers", counted)
    return calls


@pytest.mark.parametrize("speculative, kv_dtype, qkv_bias", [(None, "float16", False), (None, "model", False),
                                                              ("ngram", "float16", False), ("ngram", "model", False),
                                                              (None, "float16", True), ("ngram", "model", True)])
def test_engine_on_the_stack_equals_the_layer_loop(monkeypatch, speculative, kv_dtype, qkv_bias):
    """Shared prompts, n = 2 (steps of up to 6 rows: within the kernel's 8 on every CPU), chunked
    prefill beside decode rows (those steps keep the loop), multi-token extends (speculation): the
    same tokens and log-probabilities bit for bit."""
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.sampling.params import SamplingParams

    model = tiny_block_model()
    if qkv_bias:  # Qwen2's q/k/v biases: on the stack too
        g = torch.Generator().manual_seed(11)
        for layer in model.layers:
            layer["qkv_bias"] = torch.randn(layer["qkv"].out_features, generator=g) * 0.5
    calls = count_stack_steps(monkeypatch)
    rng = random.Random(3)
    system = [rng.randrange(29) for _ in range(37)]
    prompts = [system + [rng.randrange(29) for _ in range(rng.randint(1, 20))] for _ in range(2)]
    prompts.append([rng.randrange(29) for _ in range(90)])
    outs, steps = {}, {}
    for on in (True, False):
        use_stack(model, on)
        calls["n"] = 0
        engine = Engine(model, lambda ids: " ".join(map(str, ids)), (), EngineConfig(
            num_blocks=96, decode_kernel="cpu", block_size=8, max_batch_tokens=24, speculative=speculative,
            kv_dtype=kv_dtype))
        states = [engine.add_request(p, SamplingParams(n=2, max_tokens=14, temperature=1.0, seed=i))
                  for i, p in enumerate(prompts)]
        engine.run()
        engine.check_integrity()
        outs[on], steps[on] = [st.output for st in states], calls["n"]
    assert steps[True] > 10 and steps[False] == 0
    for a, b in zip(outs[True], outs[False]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids and sa.logprobs == sb.logprobs


def as_blocks(w: torch.Tensor, kind: str):
    """float [N, K] -> forklm's block layout `kind`, rounded the plain way (min/max per block; K-quant
    block scales and minima as 6-bit multiples of float16 super-block scales)."""
    from forklm.kernels import block_gemm as bg
    from forklm.models.quant import BlockQuantized

    if kind in ("q4_k_r8", "q5_k_r8", "q6_k_r8"):  # (the layouts GGUF Q4_K / Q5_K / Q6_K files load as)
        return bg.interleave_r8(as_blocks(w, kind[:-3]))
    if kind == "f16":  # float weights as stored, gathered as a file's fused q/k/v is: parts where they lie
        h, half = w.to(torch.float16), w.shape[0] // 2
        order = torch.arange(half).flip(0)  # the first part's rows stored reversed
        return bg.gather_half([(h[:half][order].contiguous(), order), (h[half:].contiguous(), None)])
    if kind in bg.HALF_KINDS:  # float weights as stored (GGUF BF16 / F16)
        return bg.pack_half(w.to(bg.HALF_DTYPES[kind]))
    n, k = w.shape
    blocks = w.float().view(n, k // 32, 32)
    if kind in ("q8_0", "q8_0_r8"):  # (plain: the layout no file loads as now, still run by the stack)
        d = (blocks.abs().amax(-1) / 127).half().float().clamp_min(1e-6)
        b = BlockQuantized("q8_0", torch.round(blocks / d.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(n, k), d)
        return b.to_block_weights() if kind == "q8_0_r8" else bg.pack_q8_0(b.q, b.d)
    if kind == "q6_k":
        scale = blocks.view(n, -1, 16).abs().amax(-1) / 31  # per 16 values
        ds = (scale.view(n, -1, 16).amax(-1) / 127).half().float().clamp_min(1e-6)
        sc = torch.round(scale / ds.repeat_interleave(16, 1)).clamp(1, 127)
        step = (ds.repeat_interleave(16, 1) * sc).unsqueeze(-1)
        q = torch.round(w.float().view(n, -1, 16) / step).clamp(-32, 31).to(torch.int8).view(n, k)
        return bg.pack_q6_k(q, ds, sc.to(torch.int8))
    if kind in ("iq4_nl", "iq4_nl_r8"):  # the nearest of the 16 levels under a per-block scale
        d = (blocks.abs().amax(-1) / 127).half().float().clamp_min(1e-6)
        levels = bg.IQ4_NL_LEVELS.float()
        q = (blocks / d.unsqueeze(-1)).unsqueeze(-1).sub(levels).abs().argmin(-1).to(torch.uint8).view(n, k)
        return bg.interleave_r8(bg.pack_iq4_nl(q, d)) if kind == "iq4_nl_r8" else bg.pack_iq4_nl(q, d)
    if kind == "iq4_xs":  # the nearest level under a 6-bit scale per 32 of a float16 scale per 256
        d32 = blocks.abs().amax(-1) / 127
        ds = (d32.view(n, -1, 8).amax(-1) / 31).half().float().clamp_min(1e-6)
        sc = torch.round(d32 / ds.repeat_interleave(8, 1)).clamp(1, 31)
        step = (ds.repeat_interleave(8, 1) * sc).unsqueeze(-1)
        q = (blocks / step).unsqueeze(-1).sub(bg.IQ4_NL_LEVELS.float()).abs().argmin(-1).to(torch.uint8).view(n, k)
        return bg.pack_iq4_xs(q, ds, sc.to(torch.int8))
    if kind == "q3_k":
        scale = blocks.view(n, -1, 16).abs().amax(-1) / 4  # per 16 values, q in −4..3
        ds = (scale.view(n, -1, 16).amax(-1) / 31).half().float().clamp_min(1e-6)
        sc = torch.round(scale / ds.repeat_interleave(16, 1)).clamp(1, 31)
        step = (ds.repeat_interleave(16, 1) * sc).unsqueeze(-1)
        q = torch.round(w.float().view(n, -1, 16) / step).clamp(-4, 3).to(torch.int8).view(n, k)
        return bg.pack_q3_k(q, ds, sc.to(torch.int8))
    if kind == "q2_k":
        v = w.float().view(n, -1, 16)
        lo = v.amin(-1).clamp_max(0)
        d = (v.amax(-1) - lo) / 3
        ds = (d.view(n, -1, 16).amax(-1) / 15).half().float().clamp_min(1e-6)
        dmin = ((-lo).view(n, -1, 16).amax(-1) / 15).half().float().clamp_min(1e-6)
        sc = torch.round(d / ds.repeat_interleave(16, 1)).clamp(1, 15)
        mn = torch.round(-lo / dmin.repeat_interleave(16, 1)).clamp(0, 15)
        step, minimum = (ds.repeat_interleave(16, 1) * sc).unsqueeze(-1), (dmin.repeat_interleave(16, 1) * mn).unsqueeze(-1)
        q = torch.round((v + minimum) / step).clamp(0, 3).to(torch.uint8).view(n, k)
        return bg.pack_q2_k(q, ds, dmin, sc.to(torch.uint8), mn.to(torch.uint8))
    if kind in ("q4_0_r8", "q5_0_r8"):  # symmetric: w = d·(q − 8) / d·(q − 16)
        half = 8 if kind == "q4_0_r8" else 16
        d = (blocks.abs().amax(-1) / half).half().float().clamp_min(1e-6)
        q = (torch.round(blocks / d.unsqueeze(-1)) + half).clamp(0, 2 * half - 1).to(torch.uint8).view(n, k)
        if kind == "q4_0_r8":
            return bg.pack_q4_0_r8(q, d)
        return bg.interleave_r8(bg.pack_q5_1(q, d, -half * d), minima=False)
    qmax = 15 if kind.startswith("q4") else 31
    lo = blocks.amin(-1).clamp_max(0)
    d = ((blocks.amax(-1) - lo) / qmax).clamp_min(1e-6)
    if kind in ("q5_1", "q4_1_r8", "q5_1_r8"):
        d, lo = d.half().float(), lo.half().float()
        q = torch.round((blocks - lo.unsqueeze(-1)) / d.unsqueeze(-1)).clamp(0, qmax).to(torch.uint8).view(n, k)
        w = BlockQuantized(kind[:4], q, d, lo).to_block_weights()
        return bg.interleave_r8(w) if kind == "q5_1_r8" else w
    ds = (d.view(n, -1, 8).amax(-1) / 63).half().float()
    dm = (lo.view(n, -1, 8).amin(-1) / 63).half().float().clamp_max(-1e-6)
    sc = torch.round(d / ds.repeat_interleave(8, 1)).clamp(1, 63)
    mq = torch.round(lo / dm.repeat_interleave(8, 1)).clamp(0, 63)
    scale, minimum = (ds.repeat_interleave(8, 1) * sc).unsqueeze(-1), (dm.repeat_interleave(8, 1) * mq).unsqueeze(-1)
    q = torch.round((blocks - minimum) / scale).clamp(0, qmax).to(torch.uint8).view(n, k)
    if kind == "q5_k":
        q[0, 0] = 31  # at least one value with its fifth bit
    return bg.pack_k_quant(q, ds, sc.to(torch.uint8), dm, mq.to(torch.uint8))


def test_every_block_layout_runs_on_the_stack_as_in_the_loop(monkeypatch):
    """Interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS, BF16 and F16 matrices mixed across a model's layers: the
    stack's samples and log-probabilities equal the layer loop's bit for bit."""
    from conftest import tiny_llama

    from forklm.engine.engine import Engine, EngineConfig
    from forklm.models.quant import BlockLinear
    from forklm.sampling.params import SamplingParams

    model = tiny_llama(29, 256, 4, 2, 64, 512, 4, torch.float32, seed=3, max_positions=1024, quantize="int4")
    kinds = ["q5_0_r8", "q4_k_r8", "q5_k_r8", "q8_0_r8", "q6_k_r8", "iq4_xs", "q2_k", "iq4_nl_r8", "q3_k", "q4_0_r8",
             "q4_1_r8", "q5_1_r8", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k"]  # o: 1, 3, 5, 7
    for i, layer in enumerate(model.layers):
        for j, name in enumerate(("qkv", "o", "gate_up", "down")):
            layer[name] = BlockLinear(as_blocks(layer[name].dequantize(), kinds[(2 * i + j) % len(kinds)]))
    # fused matrices whose parts take different layouts (a Q5_0 q and k beside a Q8_0 v; Q4_K beside
    # Q6_K; Q2_K beside Q3_K, as a Q2_K file mixes them)
    pairs = (("q5_0_r8", "q8_0_r8"), ("q4_k_r8", "q6_k_r8"), ("q2_k", "q3_k"), ("iq4_xs", "q5_k_r8"))
    for layer, (a, b) in zip(model.layers, pairs):
        w = layer["qkv"].dequantize()
        layer["qkv"] = BlockLinear([as_blocks(w[:256], a), as_blocks(w[256:], b)] if a != "q5_0_r8" else
                                   [as_blocks(w[:128], "q5_1_r8"), as_blocks(w[128:256], a), as_blocks(w[256:], b)])
        w = layer["gate_up"].dequantize()
        layer["gate_up"] = BlockLinear([as_blocks(w[:512], b), as_blocks(w[512:], a)])
        w = layer["down"].dequantize()  # the residual fused into parts: each its columns
        layer["down"] = BlockLinear([as_blocks(w[:96], a), as_blocks(w[96:], b)])
    for i, kind in ((0, "q4_0_r8"), (2, "q4_1_r8")):  # the interleaved 4-bit layouts (files' Q4_0 / Q4_1)
        model.layers[i]["o"] = BlockLinear(as_blocks(model.layers[i]["o"].dequantize(), kind))
    # the plain layouts (no file loads them now; the stack still runs them), middle parts of down
    for i, middle in ((1, ("q8_0", "bf16")), (3, ("iq4_nl", "f16")), (0, ("q4_k", "q6_k")), (2, ("q5_k",))):
        w = model.layers[i]["down"].dequantize()
        a, b = pairs[i]
        rows = 64 // len(middle)
        model.layers[i]["down"] = BlockLinear([as_blocks(w[:96], a)] + [
            as_blocks(w[96 + j * rows:96 + (j + 1) * rows], kind) for j, kind in enumerate(middle)] + [as_blocks(w[160:], b)])
    assert {layer["qkv"].kind for layer in model.layers} == {"q5_1_r8+q5_0_r8+q8_0_r8", "q4_k_r8+q6_k_r8", "q2_k+q3_k",
                                                             "iq4_xs+q5_k_r8"}
    assert {layer["o"].kind for layer in model.layers} == {"q4_0_r8", "q8_0_r8", "q4_1_r8", "iq4_nl_r8"}
    used = {part.kind for layer in model.layers for w in layer.values() if isinstance(w, BlockLinear) for part in w.parts}
    assert used == set(kinds) | {"bf16", "f16"}, set(kinds) - used  # every layout on the stack somewhere
    calls = count_stack_steps(monkeypatch)
    prompts = [[random.Random(i).randrange(29) for _ in range(30 + 7 * i)] for i in range(3)]
    outs = {}
    for on in (True, False):
        use_stack(model, on)
        assert (model._decode_stack is not None) == on
        calls["n"] = 0
        engine = Engine(model, lambda ids: " ".join(map(str, ids)), (), EngineConfig(
            num_blocks=96, decode_kernel="cpu", block_size=8, max_batch_tokens=24))
        states = [engine.add_request(p, SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=i))
                  for i, p in enumerate(prompts)]
        engine.run()
        engine.check_integrity()
        outs[on] = [st.output for st in states]
        assert (calls["n"] > 5) == on
    for a, b in zip(outs[True], outs[False]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids and sa.logprobs == sb.logprobs


def test_default_model_samples_the_same_on_the_stack(monkeypatch, smollm2_gguf):
    """SmolLM2's GGUF blocks (Q4_1 layers), one sample and eight sharing a prompt."""
    from forklm import LLM

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", quantize="auto")
    calls = count_stack_steps(monkeypatch)
    prompt = "def quicksort(xs):\n    "
    got = {}
    for on in (True, False):
        use_stack(llm.model, on)
        got[on] = [llm.sample(prompt, n=n, max_tokens=12, temperature=0.9, top_p=0.95, seed=5) for n in (1, 8)]
    assert calls["n"] >= 2 * 11
    for a, b in zip(got[True], got[False]):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert [s.logprobs for s in a.samples] == [s.logprobs for s in b.samples]


@pytest.mark.skipif(not amx_tiles_expected(), reason="no AMX-INT8, no AVX512-VNNI, or Linux before 5.16")
def test_samples_on_amx_tiles_equal_the_vector_tiles(smollm2_gguf):
    """SmolLM2's file (Q4_1 layers, a Q8_0 head), 16 samples a step (AMX_MIN_ROWS) on the stack and the head on the block
    kernel: with the AMX tiles on (both modules) the tokens and log-probabilities of the vector tiles."""
    from forklm import LLM

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", quantize="auto")
    assert llm.model._decode_stack is not None or decode_stack.unsupported_reason(llm.model) is None
    got = {}
    try:
        for on in (False, True):
            bg._extension().set_amx(on)
            decode_stack._extension().set_amx(on)
            assert bg.uses_amx() == on and decode_stack._extension().amx_enabled() == on
            out = llm.sample("def quicksort(xs):\n    ", n=16, max_tokens=12, temperature=0.9, top_p=0.95, seed=5,
                             attention="bifurcated")
            got[on] = [(s.token_ids, s.logprobs) for s in out.samples]
    finally:
        bg._extension().set_amx(True)
        decode_stack._extension().set_amx(True)
    assert got[True] == got[False]


def test_models_off_the_block_kernel_get_no_stack():
    from conftest import tiny_llama

    assert decode_stack.build(tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.float32, seed=1)) is None  # dense weights
    assert decode_stack.build(tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.bfloat16, seed=1, quantize="int4")) is None
    stack = decode_stack.build(tiny_block_model())
    assert stack is not None and stack.kernel.num_layers == 2 and stack.max_rows >= 1


def test_a_malformed_stack_is_refused_with_a_message():
    model = tiny_block_model()
    ext = decode_stack._extension()
    layer = model.layers[0]
    with pytest.raises(RuntimeError, match="2 norms and 4 block matrices per layer"):
        ext.DecodeStack([layer["attn_norm"]], [], [], 1e-5, 4)
    with pytest.raises(RuntimeError, match="unknown block layout q9_9"):
        ext.DecodeStack([layer["attn_norm"], layer["mlp_norm"]], [["q9_9"]] * 4, [[[]]] * 4, 1e-5, 4)


def test_the_environment_switch_turns_the_stack_off():
    import os
    import subprocess
    import sys

    code = "from forklm.kernels import decode_stack; print(decode_stack.available(), decode_stack.build_error())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FORKLM_DECODE_STACK": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False disabled by FORKLM_DECODE_STACK=0"
