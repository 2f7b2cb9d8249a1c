"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2`): random-weight checkpoints written by
transformers, converted by llama.cpp's own convert_hf_to_gguf.py (which stacks the routed experts
into [E, rows, k] tensors and splits kv_b_proj into attn_k_b / attn_v_b), then requantized to block
types. The float file gives transformers' logits and greedy tokens; the quantized file runs its
experts and projections on the block kernel as stored (no dense copies), close to its own
dequantized values; what the file cannot say is refused by name."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

from forklm import LLM
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.models.deepseek import DeepseekModel
from forklm.kernels import block_gemm
from forklm.models.quant import BlockLinear

from conftest import hf_greedy, rel_err
from gguf_files import SMOLLM2_VOCAB, convert_hf_folder, requantize
from test_deepseek import DenseLatentAttention, randomize

TOL = 1e-4
# block-type-friendly widths (every in_features a multiple of 32), SmolLM2's vocabulary (a tokenizer
# the converter knows)
SHAPE = dict(vocab_size=SMOLLM2_VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
             n_shared_experts=1, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}  # as DeepSeek-V2-Lite's
VARIANTS = {
    # V2: softmax, group-limited (groups ranked by their best expert), q straight from the hidden state, tied
    "v2-group": (DeepseekV2Config, dict(q_lora_rank=None, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                        n_group=4, topk_group=2, tie_word_embeddings=True,
                                        routed_scaling_factor=1.5)),
    # V3: sigmoid + correction bias, groups by their top-2 sum, q LoRA, YaRN; scoring_func written into
    # config.json as DeepSeek's own configs carry it (the converter reads it; transformers drops it)
    "v3-yarn": (DeepseekV3Config, dict(q_lora_rank=64, num_experts_per_tok=2, n_group=4, topk_group=2,
                                       rope_parameters=dict(YARN))),
}
_cache: dict = {}


def mixed_types(name: str, k: int) -> str | None:
    """Attention Q8_0 / Q5_0, the dense MLP Q4_1, routed experts Q4_0 (down Q5_1), shared Q8_0; W_UK /
    W_UV and the router Q8_0 too (read back as float32)."""
    if name in ("token_embd.weight", "output.weight"):
        return "Q8_0"
    part = name.split(".")[2] if name.startswith("blk.") else ""
    return {"attn_q": "Q8_0", "attn_q_a": "Q5_0", "attn_q_b": "Q8_0", "attn_kv_a_mqa": "Q8_0",
            "attn_k_b": "Q8_0", "attn_v_b": "Q8_0", "ffn_gate_inp": "Q8_0",
            "attn_output": "Q5_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1",
            "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q5_1",
            "ffn_gate_shexp": "Q8_0", "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q8_0"}.get(part)


@pytest.fixture(scope="module", params=list(VARIANTS))
def files(request, tmp_path_factory, smollm2_gguf):
    """(variant, transformers' model, the converted float32 file, the same requantized to block types)."""
    variant = request.param
    config_cls, kw = VARIANTS[variant]
    torch.manual_seed(0)
    hf = randomize(AutoModelForCausalLM.from_config(config_cls(**{**SHAPE, **kw}), dtype=torch.float32).eval())
    folder = tmp_path_factory.mktemp(variant)
    hf.save_pretrained(folder)
    if variant.startswith("v3"):
        written = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**written, "scoring_func": "sigmoid"}))
    f32 = convert_hf_folder(folder, folder / f"{variant}-f32.gguf", smollm2_gguf)
    return variant, hf, f32, requantize(f32, folder / f"{variant}-mixed.gguf", mixed_types)


def test_converted_file_is_the_checkpoint(files):
    """The file's layout as llama.cpp writes it (stacked experts, k_b / v_b), its config as transformers'."""
    from forklm.models.gguf_file import read_gguf

    variant, hf, f32, _ = files
    meta, tensors = read_gguf(f32)
    names = {t.name for t in tensors}
    assert meta["general.architecture"] == "deepseek2"
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"} <= names
    c = LLM(str(f32), dtype="float32").config
    want = hf.config
    assert (c.architecture, c.num_layers, c.q_lora_rank, c.kv_lora_rank) == (
        want.model_type, want.num_hidden_layers, want.q_lora_rank, want.kv_lora_rank)
    assert (c.n_group, c.topk_group, c.num_experts_per_tok, c.routed_scaling_factor) == (
        want.n_group, want.topk_group, want.num_experts_per_tok, want.routed_scaling_factor)
    assert c.scoring_func == ("sigmoid" if variant.startswith("v3") else "softmax")
    assert c.rope.rope_type == ("yarn" if "yarn" in variant else "default")
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert c.num_parameters() == sum(p.numel() for p in hf.parameters()) + bias
    E, k, moe_layers = c.n_routed_experts, c.num_experts_per_tok, c.num_layers - c.first_k_dense_replace
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    assert c.num_parameters() - c.num_parameters(active=True) == moe_layers * (E - k) * per_expert


def test_float_file_logits_match_transformers(files):
    """Prefill and one-token decode logits of the float32 file == transformers' (float32 rounding)."""
    _, hf, f32, _ = files
    model = LLM(str(f32), dtype="float32").model
    assert isinstance(model, DeepseekModel)
    ids = torch.randint(0, SMOLLM2_VOCAB, (17,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    attention = DenseLatentAttention()
    prefill = model.forward(ids[:12], torch.arange(12), attention)
    decode = torch.cat([model.forward(ids[t : t + 1], torch.tensor([t]), attention) for t in range(12, 17)])
    assert rel_err(prefill, ref[:12]) < TOL and rel_err(decode, ref[12:]) < TOL
    assert ref.std() > 0.3


def test_float_file_greedy_on_the_engine(files):
    """The engine (latent pool, absorbed decode, the prompt shared by 3 samples) == transformers' greedy."""
    _, hf, f32, _ = files
    llm = LLM(str(f32), dtype="float32")
    prompt = torch.randint(3, SMOLLM2_VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    seq, _ = hf_greedy(hf, prompt, 8)
    out = llm.sample(prompt, n=3, max_tokens=8, temperature=0.0, ignore_eos=True)
    for s in out.samples:
        assert s.token_ids == seq[len(prompt):]


def test_quantized_experts_are_the_checkpoints(files):
    """Each routed expert of the quantized file, read back dense, is that expert of transformers'
    checkpoint within its block type's rounding (not a neighbour's: the stacked tensor's row ranges),
    and the requantized W_UK / W_UV and router close to transformers' too."""
    _, hf, _, mixed = files
    model = LLM(str(mixed), dtype="float32", quantize=None).model
    params = dict(hf.named_parameters())
    for i in (1, 2):
        mlp, pre = model.layers[i]["mlp"], f"model.layers.{i}.mlp."
        gate_up, down = params[pre + "experts.gate_up_proj"], params[pre + "experts.down_proj"]  # [E, 2I, H], [E, H, I]
        as_out_in = lambda w, out: w if w.shape[0] == out else w.t()  # noqa: E731 (the backend's layout)
        for e, expert in enumerate(mlp.experts):
            ours_gu, ours_d = as_out_in(expert.gate_up, gate_up.shape[1]), as_out_in(expert.down, down.shape[1])
            assert rel_err(ours_gu, gate_up[e]) < 0.15 and rel_err(ours_d, down[e]) < 0.08  # Q4_0, Q5_1
            assert rel_err(ours_gu, gate_up[(e + 1) % len(mlp.experts)]) > 1.0
        assert rel_err(mlp.router.weight, params[pre + "gate.weight"]) < 0.02  # Q8_0
        attn, kv_b = model.layers[i]["attn"], params[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        c = model.config
        kv_b = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        assert rel_err(attn.w_uk_t.transpose(1, 2), kv_b[:, : c.qk_nope_head_dim]) < 0.02
        assert rel_err(attn.w_uv, kv_b[:, c.qk_nope_head_dim :]) < 0.02


@pytest.mark.skipif(not block_gemm.available(), reason="the block kernel is not built here")
def test_quantized_file_runs_as_stored(files):
    """Every expert, the shared experts, the dense MLP and the attention's projections on the block
    kernel over the file's blocks (no dense copy); logits those of the dequantized file (the float
    path, quantize=None) within the kernel's activation rounding."""
    _, _, _, mixed = files
    fast = LLM(str(mixed), dtype="float32")
    assert fast.quantize == "gguf"
    model = fast.model
    for i, layer in enumerate(model.layers):
        mats = [layer["attn"].q_kv_a, layer["attn"].o]
        mats += ([layer["mlp"].gate_up, layer["mlp"].down] if i == 0 else
                 [m for e in layer["mlp"].experts + [layer["mlp"].shared] for m in (e.gate_up, e.down)])
        for w in mats:
            assert isinstance(w, BlockLinear) and w.dense is None
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.dense is None
    assert model.embed is None  # rows looked up in the stored table
    from forklm.info import report

    layers = report(fast)["model"]["layers"]  # `forklm info`: each product's stored types and kernel
    assert layers["expert gate_up: Q4_0+Q4_0 -> block kernel (q4_0_r8 layout, Q8 activations)"].startswith("16 experts")
    assert any(k.startswith("expert down: Q5_1 -> block kernel") for k in layers)
    dense = LLM(str(mixed), dtype="float32", quantize=None).model
    ids = torch.randint(0, SMOLLM2_VOCAB, (14,), generator=torch.Generator().manual_seed(5))
    a = model.forward(ids, torch.arange(14), DenseLatentAttention())
    b = dense.forward(ids, torch.arange(14), DenseLatentAttention())
    assert rel_err(a, b) < 0.05  # activations rounded to 8 bits per block by the kernel (2-3% here)


def test_quantized_file_bifurcated_equals_standard(files):
    """Seeded samples from the quantized file: a sample does not depend on how many are drawn (every
    product row-independent; one sample alone takes standard attention, below), and the shared prompt's latents read once for all samples or per sample
    give the same log-probs (float32 rounding apart) until a sample's first near-tie: the two attention
    orders round differently, and the kernels' 8-bit activations can turn that into another token on
    this random model's flat distributions (README: no batch-invariant quantized path yet)."""
    _, _, _, mixed = files
    llm = LLM(str(mixed), dtype="float32")
    prompt = torch.randint(3, SMOLLM2_VOCAB, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    req = dict(prompt=prompt, n=6, max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    a, = llm.generate([req], shared_attention="bifurcated")
    b, = llm.generate([req], shared_attention="standard")
    assert a.stats.path_steps.get("bifurcated", 0) > 0
    for n in (3, 2):  # every product each row's own: the block kernel's, `dense_rows` (router, W_UK / W_UV)
        c, = llm.generate([{**req, "n": n}], shared_attention="bifurcated")
        assert c.stats.path_steps.get("bifurcated", 0) > 0
        assert [s.token_ids for s in c.samples] == [s.token_ids for s in a.samples[:n]]
        assert [s.logprobs for s in c.samples] == [s.logprobs for s in a.samples[:n]]
    # one sample shares nothing, so it takes standard attention, whose order rounds differently from the
    # bifurcated one on the latent pool (README): the same tokens until a near-tie, log-probs to rounding
    one, = llm.generate([{**req, "n": 1}], shared_attention="bifurcated")
    assert set(one.stats.path_steps) == {"standard"}
    x, y = one.samples[0], a.samples[0]
    same = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), len(x.token_ids))
    assert same >= 1 and rel_err(torch.tensor(x.logprobs[:same]), torch.tensor(y.logprobs[:same])) < 2e-3
    agree = 0
    for x, y in zip(a.samples, b.samples):
        same = next((i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q), len(x.token_ids))
        assert same >= 1
        agree += same
        assert rel_err(torch.tensor(x.logprobs[:same]), torch.tensor(y.logprobs[:same])) < 2e-3
    assert agree >= 0.75 * 6 * 8


def test_what_the_file_cannot_say_is_refused(files, tmp_path):
    _, _, f32, _ = files
    U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    cases = [  # (name, a metadata change or the tensors dropped, the error, its message)
        ("gating", {"deepseek2.expert_gating_func": (3, U32)}, UnsupportedModelError, "expert_gating_func=3"),
        ("missing", lambda n: n == "blk.2.ffn_up_exps.weight", ModelFileError,
         "missing tensor for model.layers.2.mlp.experts.up_proj"),
        ("groups", {"deepseek2.expert_group_count": (3, U32)}, ModelFileError, "expert_group_count 3"),
        ("scaling", {"deepseek2.rope.scaling.type": ("longrope", STR)}, UnsupportedModelError, "longrope"),
        ("temperature", {"deepseek2.attention.temperature_scale": (0.1, F32)}, UnsupportedModelError,
         "temperature_scale"),
        ("shape", {"deepseek2.expert_feed_forward_length": (32, U32)}, ModelFileError,
         r"blk.1.ffn_\w+_exps.weight' has shape"),
    ]
    for name, change, error, message in cases:
        how = dict(drop=change) if callable(change) else dict(fields=change)
        bad = requantize(f32, tmp_path / f"{name}.gguf", lambda n, k: None, **how)
        with pytest.raises(error, match=message):
            LLM(str(bad))


def test_older_file_layout_loads(files, tmp_path):
    """Files written before llama.cpp's MLA cache (2025): kv_b_proj whole as attn_kv_b, the per-head
    key / value lengths in key_length / value_length, no *_mla keys. The same logits. (attn_kv_b is
    built from the converted file's k_b / v_b here; that the float file equals transformers is the
    test above.)"""
    from forklm.models.gguf_file import read_gguf

    _, _, f32, _ = files
    meta, tensors = read_gguf(f32)
    c = LLM(str(f32), dtype="float32").config
    kv_b = {}
    for t in tensors:
        if t.name.endswith("attn_k_b.weight"):
            layer = t.name.split(".")[1]
            k_b = torch.from_numpy(t.data.copy())  # [h, r, dn]
            v_b = torch.from_numpy(next(u for u in tensors if u.name == f"blk.{layer}.attn_v_b.weight").data.copy())
            kv_b[f"blk.{layer}.attn_kv_b.weight"] = torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(-1, k_b.shape[1]).numpy()
    U32 = gguf.GGUFValueType.UINT32
    old = requantize(f32, tmp_path / "old.gguf", lambda name, k: None, add=kv_b,
                     drop=lambda n: n.endswith(("attn_k_b.weight", "attn_v_b.weight")),
                     fields={"deepseek2.attention.key_length": (c.qk_head_dim, U32),
                             "deepseek2.attention.value_length": (c.v_head_dim, U32),
                             "deepseek2.attention.key_length_mla": (None, U32),
                             "deepseek2.attention.value_length_mla": (None, U32)})
    ids = torch.randint(0, SMOLLM2_VOCAB, (9,), generator=torch.Generator().manual_seed(7))
    a = LLM(str(old), dtype="float32").model.forward(ids, torch.arange(9), DenseLatentAttention())
    b = LLM(str(f32), dtype="float32").model.forward(ids, torch.arange(9), DenseLatentAttention())
    assert rel_err(a, b) < 1e-6
