"""DeepSeek-V2/V3 (multi-head latent attention, absorbed): random-weight checkpoints written by
transformers' save_pretrained, loaded into forklm's DeepseekModel: logits == transformers', prefill and
decode; greedy identical; absorbed == expanded; the latents == what transformers caches; unsupported
configs refused by name."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from forklm.backend import Backend
from forklm.errors import UnsupportedModelError
from forklm.models.deepseek import DeepseekConfig, DeepseekModel
from forklm.models.hf_loader import load_hf_weights

from conftest import rel_err

TOL = 1e-4
SMALL = dict(vocab_size=320, hidden_size=96, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, kv_lora_rank=32,
             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
             max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

# rms_norm_eps 1e-2 in two: the layer norms take it, q_a / kv_a_layernorm keep transformers' default 1e-6
VARIANTS = {
    "v2-qlora-greedy": (DeepseekV2Config, dict(q_lora_rank=48, num_experts_per_tok=2, topk_method="greedy",
                                               routed_scaling_factor=1.5, rms_norm_eps=1e-2)),
    "v2-q-group": (DeepseekV2Config, dict(q_lora_rank=None, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                          n_group=4, topk_group=2, tie_word_embeddings=True)),
    "v2-yarn": (DeepseekV2Config, dict(q_lora_rank=48, num_experts_per_tok=2, rope_parameters=dict(YARN))),
    "v3-qlora": (DeepseekV3Config, dict(q_lora_rank=48, num_experts_per_tok=2, n_group=4, topk_group=2)),
    "v3-q-half": (DeepseekV3Config, dict(q_lora_rank=None, num_experts_per_tok=3, n_group=2, topk_group=1,
                                         rope_interleave=False, norm_topk_prob=False, rms_norm_eps=1e-2)),
    "v3-yarn": (DeepseekV3Config, dict(q_lora_rank=48, num_experts_per_tok=2, n_group=4, topk_group=2,
                                       rope_parameters=dict(YARN))),
}
CPU = torch.device("cpu")
_cache: dict = {}


class DenseLatentAttention:
    """The slow oracle of `attend_latent`: every layer's latents kept in a list, each call's queries
    attending causally over all of them (so a prefill, then one token at a time, works)."""

    def __init__(self) -> None:
        self.latents: dict[int, list[torch.Tensor]] = {}

    def attend_latent(self, layer, q, latent, v_dim, scale):  # q [T, h, Dk], latent [T, Dk] -> [T, h, v_dim]
        self.latents.setdefault(layer, []).append(latent)
        kv = torch.cat(self.latents[layer])  # [S, Dk]
        S, T = kv.shape[0], q.shape[0]
        scores = torch.einsum("thd,sd->ths", q.float(), kv.float()) * scale
        future = torch.arange(S)[None, :] > torch.arange(S - T, S)[:, None]  # [T, S]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))
        return torch.einsum("ths,sv->thv", scores.softmax(-1), kv[:, :v_dim].float()).to(q.dtype)

    def cached(self, layer: int) -> torch.Tensor:
        return torch.cat(self.latents[layer])


def randomize(hf):
    """transformers' DeepSeek model with weights of some scale (norms near 1, so logits are not
    near-uniform), the correction bias random too."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return hf


def build(tmp_path_factory, variant: str, seed: int = 0):
    """(transformers model, its folder): random weights with some scale (norms near 1, so logits are not
    near-uniform), the correction bias random too."""
    if variant in _cache:
        return _cache[variant]
    config_cls, kw = VARIANTS[variant]
    torch.manual_seed(seed)
    cfg = config_cls(**{**SMALL, **kw})
    cfg._attn_implementation = "eager"
    hf = randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())
    folder = tmp_path_factory.mktemp(variant)
    hf.save_pretrained(folder)
    _cache[variant] = (hf, folder)
    return hf, folder


def load(folder: Path, backend: Backend | None = None) -> DeepseekModel:
    cfg = DeepseekConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    return DeepseekModel(cfg, load_hf_weights(folder), backend or Backend.exact(torch.float32, CPU))


def run(model: DeepseekModel, prompt: torch.Tensor, steps: torch.Tensor, attention=None):
    """Prefill logits [P, V], then each decode token's [len(steps), V], fed one token at a time."""
    attention = attention or DenseLatentAttention()
    prefill = model.forward(prompt, torch.arange(len(prompt)), attention)
    decode = [model.forward(tok[None], torch.tensor([len(prompt) + t]), attention) for t, tok in enumerate(steps)]
    return prefill, torch.cat(decode), attention


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path_factory, variant):
    hf, folder = build(tmp_path_factory, variant)
    model = load(folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (17,), generator=g)
    prompt, steps = ids[:12], ids[12:]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()  # every position of prompt + decode tokens
    prefill, decode, _ = run(model, prompt, steps)
    e_prefill, e_decode = rel_err(prefill, ref[:12]), rel_err(decode, ref[12:])
    print(f"{variant}: prefill rel err {e_prefill:.2e}, decode rel err {e_decode:.2e}")
    assert e_prefill < TOL and e_decode < TOL
    assert ref.std() > 0.3  # the logits carry signal (not near-uniform)
    last = model.forward(prompt, torch.arange(12), DenseLatentAttention(), logits_rows=torch.tensor([11]))
    assert rel_err(last, ref[11:12]) < TOL


def test_weight_layouts_agree(tmp_path_factory):
    """The checkpoint's own layout ("out_in", F.linear) gives the transposed one's logits."""
    hf, folder = build(tmp_path_factory, "v3-qlora")
    ids = torch.randint(0, SMALL["vocab_size"], (9,), generator=torch.Generator().manual_seed(2))
    a = load(folder, Backend.exact(torch.float32, CPU, weight_layout="in_out")).forward(
        ids, torch.arange(9), DenseLatentAttention())
    b = load(folder, Backend.exact(torch.float32, CPU, weight_layout="out_in")).forward(
        ids, torch.arange(9), DenseLatentAttention())
    assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("variant", ["v2-q-group", "v2-yarn", "v3-qlora", "v3-q-half"])
def test_greedy_identical(tmp_path_factory, variant):
    hf, folder = build(tmp_path_factory, variant)
    model = load(folder)
    prompt = torch.randint(0, SMALL["vocab_size"], (10,), generator=torch.Generator().manual_seed(3))
    seq = prompt.tolist()
    with torch.no_grad():  # transformers' greedy choice, recomputed over the whole sequence each step
        for _ in range(10):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    ref = seq[10:]
    attention = DenseLatentAttention()
    logits = model.forward(prompt, torch.arange(10), attention, logits_rows=torch.tensor([9]))
    out = []
    for t in range(10):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = model.forward(torch.tensor([tok]), torch.tensor([10 + t]), attention)
    assert out == ref


@pytest.mark.parametrize("variant", ["v2-yarn", "v3-q-half", "v3-yarn"])
def test_absorbed_equals_expanded(tmp_path_factory, variant):
    """One layer's absorbed attention == the standard one over per-head K/V expanded from the latents
    with the checkpoint's kv_b_proj (k = [W_UK·c ; k_pe], v = W_UV·c)."""
    hf, folder = build(tmp_path_factory, variant)
    model = load(folder)
    c, layer = model.config, 1
    mla = model.layers[layer]["attn"]
    g = torch.Generator().manual_seed(4)
    T = 13
    x = torch.randn(T, c.hidden_size, generator=g)
    tables = model.rotary.tables(torch.arange(T), torch.float32)
    absorbed = mla.heads(x, layer, model.rotary, tables, DenseLatentAttention())  # [T, h, dv]

    q_nope, q_pe, latent = mla.project(x, model.rotary, tables)
    kv_b = hf.model.layers[layer].self_attn.kv_b_proj.weight.detach()  # [h·(dn + dv), r]
    kv = torch.einsum("sr,or->so", latent[:, : c.kv_lora_rank], kv_b).view(T, c.num_heads, -1)
    k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
    k = torch.cat([k_nope, latent[:, None, c.kv_lora_rank :].expand(-1, c.num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, h, dn + dr]
    scores = torch.einsum("thd,shd->hts", q, k) * c.softmax_scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    expanded = torch.einsum("hts,shv->thv", scores.softmax(-1), v)
    err = rel_err(absorbed, expanded)
    k2, v2 = mla.expand(latent)
    print(f"{variant}: absorbed vs expanded rel err {err:.2e}; expand() k {rel_err(k2, k):.2e} v {rel_err(v2, v):.2e}")
    assert err < TOL and rel_err(k2, k) < TOL and rel_err(v2, v) < TOL


@pytest.mark.parametrize("variant", ["v2-qlora-greedy", "v3-qlora", "v3-q-half"])
def test_latents_equal_transformers_cache(tmp_path_factory, variant):
    """What attend_latent is handed to store == transformers' cache: [kv_a_layernorm(c_kv) ; rotated k_pe]."""
    hf, folder = build(tmp_path_factory, variant)
    model = load(folder)
    ids = torch.randint(0, SMALL["vocab_size"], (11,), generator=torch.Generator().manual_seed(5))
    _, _, attention = run(model, ids[:8], ids[8:])
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).cache
    r = model.config.kv_lora_rank
    for i in range(model.config.num_layers):
        ours = attention.cached(i)
        assert rel_err(ours[:, :r], cache.layers[i].keys[0, 0]) < TOL
        assert rel_err(ours[:, r:], cache.layers[i].values[0, 0]) < TOL


@pytest.mark.parametrize("config_cls, rope", [
    (DeepseekV2Config, {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                        "beta_slow": 1, "original_max_position_embeddings": 4096}),  # DeepSeek-V2(-Lite)
    (DeepseekV3Config, {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                        "beta_slow": 1, "original_max_position_embeddings": 4096}),  # DeepSeek-V3 / R1
    (DeepseekV3Config, {"rope_type": "yarn", "factor": 8, "mscale": 1.0, "mscale_all_dim": 0.5,
                        "original_max_position_embeddings": 2048}),
])
def test_yarn_matches_transformers(config_cls, rope):
    """The released configs' spelling (rope_scaling with "type"): inverse frequencies, cos/sin factor and
    softmax scale as transformers computes them, at the released head sizes."""
    d = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=dict(rope),
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts_per_tok=2,
             n_routed_experts=8, n_group=1 if config_cls is DeepseekV2Config else 4, topk_group=1)
    hf_cfg = config_cls(**d)
    ours = DeepseekConfig.from_hf_dict({**d, "model_type": hf_cfg.model_type})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    assert torch.equal(ours.rope.inv_freq(64), inv_freq)
    assert ours.rope.cos_sin_factor() == factor
    mod = __import__(f"transformers.models.{hf_cfg.model_type}.modeling_{hf_cfg.model_type}", fromlist=["x"])
    assert ours.softmax_scale == mod.yarn_apply_mscale(hf_cfg.rope_parameters, 192 ** -0.5)
    assert ours.softmax_scale != 192 ** -0.5 or rope["mscale_all_dim"] == 0


HUB_V3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
              intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
              num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
              kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
              topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
              first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.001,
              seq_aux=True, ep_size=1, num_nextn_predict_layers=1, hidden_act="silu", max_position_embeddings=163840,
              rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, attention_bias=False,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"})


def test_hub_v3_config_parses():
    c = DeepseekConfig.from_hf_dict(dict(HUB_V3))
    assert (c.latent_dim, c.num_heads, c.q_lora_rank, c.rope_layout) == (576, 128, 1536, "interleave")
    assert (c.topk_method, c.scoring_func, c.n_group, c.topk_group, c.num_experts_per_tok) == ("noaux_tc", "sigmoid", 8, 4, 8)
    assert c.latent_bytes_per_token(2) == 61 * 576 * 2
    mscale = 0.1 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale)


@pytest.mark.parametrize("change, name", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(model_type="deepseek_v2", topk_method="noaux_tc", scoring_func="softmax"), "topk_method"),
    (dict(model_type="deepseek_v2", topk_method="greedy", scoring_func="sigmoid"), "scoring_func"),
    (dict(model_type="deepseek_v2", topk_method="greedy", scoring_func="softmax", norm_topk_prob=True),
     "norm_topk_prob"),
    (dict(model_type="deepseek_v2", topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
          mlp_bias=True), "mlp_bias"),
    (dict(model_type="qwen2"), "model_type"),
])
def test_unsupported_config_refused_by_name(change, name):
    with pytest.raises(UnsupportedModelError, match=name):
        DeepseekConfig.from_hf_dict({**HUB_V3, **change})


def test_weights_used_or_refused(tmp_path_factory):
    """Multi-token-prediction layers (index >= num_hidden_layers) are left out; any other stray tensor
    is refused by name (quantized weights: tests/test_deepseek_engine.py)."""
    _, folder = build(tmp_path_factory, "v3-qlora")
    cfg = DeepseekConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    w = load_hf_weights(folder)
    w[f"model.layers.{cfg.num_layers}.eh_proj.weight"] = torch.randn(4, 4)  # an MTP module's tensor
    DeepseekModel(cfg, w, Backend.exact(torch.float32, CPU))
    w = load_hf_weights(folder)
    w["model.layers.0.self_attn.extra.weight"] = torch.randn(4, 4)
    with pytest.raises(UnsupportedModelError, match="self_attn.extra.weight"):
        DeepseekModel(cfg, w, Backend.exact(torch.float32, CPU))


def test_fused_expert_tensors_load(tmp_path_factory):
    """transformers' in-memory expert layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    gives the per-expert checkpoint's logits."""
    hf, folder = build(tmp_path_factory, "v2-qlora-greedy")
    cfg = DeepseekConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    fused = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    ids = torch.randint(0, SMALL["vocab_size"], (7,), generator=torch.Generator().manual_seed(6))
    a = DeepseekModel(cfg, fused, Backend.exact(torch.float32, CPU)).forward(ids, torch.arange(7), DenseLatentAttention())
    b = load(folder).forward(ids, torch.arange(7), DenseLatentAttention())
    assert rel_err(a, b) < 1e-6
