"""DeepSeek-V2 / V3 (multi-head latent attention, dense first layers, then mixture-of-experts) as
plain PyTorch, with absorbed attention.

Each token's attention state is one latent per layer, [c_kv ; k_pe] of width Dk = kv_lora_rank +
qk_rope_head_dim (512 + 64 in the released models): the thing a cache stores. Attention is absorbed:
W_UK (kv_b_proj's key rows) is folded into the query, q = [q_nope · W_UK ; q_pe], so every head is a
Dk-wide query against the latents themselves (one key head shared by all heads, its values the
latent's first kv_lora_rank dims); W_UV is applied to the weighted sum afterwards, then o_proj. The
model hands q and the new latents to `attention.attend_latent` and never owns a cache.

Numerics follow transformers 5.24's `modeling_deepseek_v2.py` / `modeling_deepseek_v3.py`: RMSNorm in
float32 (q_a / kv_a norms with eps 1e-6 whatever rms_norm_eps says, as there), rotary as each
version lays it out (V2: complex pairs; V3: interleaved pairs written out de-interleaved, or
rotate_half with rope_interleave false), YaRN's cos/sin factor and its mscale_all_dim² softmax
scale, routing as in forklm/models/moe.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from forklm.backend import Backend, head_format
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.models.llama import _WeightReader, embed_tokens, rms_norm, token_table
from forklm.models.moe import MoE, Router, SwiGLU, dense_rows_for, product_for

ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps

# transformers' defaults for keys a config.json may leave out (DeepseekV2Config / DeepseekV3Config)
_DEFAULTS = {
    "deepseek_v2": dict(first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_group=None, topk_group=None,
                        n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
                        num_experts_per_tok=None, moe_intermediate_size=1407, scoring_func="softmax"),
    "deepseek_v3": dict(first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, n_group=8, topk_group=4,
                        n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, routed_scaling_factor=2.5, topk_method="noaux_tc", norm_topk_prob=True,
                        num_experts_per_tok=8, moe_intermediate_size=2048, scoring_func="sigmoid",
                        rope_interleave=True),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekRope:
    """Rotary parameters of the qk_rope_head_dim part: plain, or YaRN as transformers applies it."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # given in the config; else from mscale / mscale_all_dim
    truncate: bool = True

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """The attention logits' scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)² under YaRN."""
        scale = qk_head_dim ** (-0.5)
        if self.rope_type != "default" and self.mscale_all_dim:
            m = _yarn_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    def inv_freq(self, dim: int) -> torch.Tensor:
        """Inverse frequencies [dim/2] float32, computed as transformers computes them."""
        if self.rope_type == "default":
            return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # extrapolation's share per frequency
        return interpolation * (1 - keep) + extrapolation * keep


@dataclass(frozen=True)
class DeepseekConfig:
    architecture: str  # "deepseek_v2" | "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int  # layers before this one are dense, the rest MoE
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    topk_method: str  # "greedy" | "group_limited_greedy" (V2, softmax) | "noaux_tc" (V3, sigmoid)
    n_group: int
    topk_group: int
    scoring_func: str  # "softmax" | "sigmoid"
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope: DeepseekRope = field(default_factory=DeepseekRope)
    rope_layout: str = "complex"  # V2 "complex" pairs; V3 "interleave" (rope_interleave) or "half"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def latent_dim(self) -> int:
        """Dk: the width of one token's cached latent per layer, [c_kv ; k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.rope.softmax_scale(self.qk_head_dim)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def latent_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes one token's latents occupy over all layers."""
        return self.num_layers * self.latent_dim * element_bytes

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the checkpoint as forklm runs it (no multi-token-prediction layers); active:
        those one token uses (num_experts_per_tok of the routed experts, not all)."""
        H, h, r, dr = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        dq = h * self.qk_head_dim
        q = H * dq if self.q_lora_rank is None else H * self.q_lora_rank + self.q_lora_rank * (dq + 1)
        attn = q + H * (r + dr) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * H
        expert = 3 * H * self.moe_intermediate_size
        routed = self.num_experts_per_tok if active else self.n_routed_experts
        moe = H * self.n_routed_experts + (routed + self.n_shared_experts) * expert
        if self.scoring_func == "sigmoid":
            moe += self.n_routed_experts
        dense, n_moe = 3 * H * self.intermediate_size, self.num_layers - self.first_k_dense_replace
        layers = self.num_layers * (attn + 2 * H) + self.first_k_dense_replace * dense + n_moe * moe
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        return layers + self.vocab_size * H + head + H

    # What the engine's paged pool reads of a model config (config.ModelConfig's names): one
    # "KV head" of width Dk per layer, the latent, whose first kv_lora_rank dims are also the values
    # (the pool holds no separate V), so absorbed decode is multi-query attention with h query heads.
    kv_shares_values = True

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.latent_dim

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return self.latent_bytes_per_token(element_bytes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "DeepseekConfig":
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"{source}: model_type {arch!r} is not a DeepSeek MLA model "
                                        f"(supported: {', '.join(ARCHITECTURES)})")
        _refuse_unsupported(cfg, arch, source)
        get = lambda key: cfg[key] if cfg.get(key) is not None else _DEFAULTS[arch].get(key)  # noqa: E731
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            layers, inter, vocab = int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
        except KeyError as e:
            raise ModelFileError(f"{source}: missing required key {e.args[0]!r}") from None
        experts = int(get("n_routed_experts"))
        topk_method = get("topk_method")
        n_group, topk_group = get("n_group"), get("topk_group")
        if topk_method == "greedy":
            n_group, topk_group = 1, 1  # unused
        if n_group is None or topk_group is None or experts % int(n_group) or not 0 < int(topk_group) <= int(n_group):
            raise ModelFileError(f"{source}: topk_method {topk_method!r} needs n_group dividing n_routed_experts "
                                 f"({experts}) and 0 < topk_group <= n_group, got {n_group} / {topk_group}")
        if arch == "deepseek_v3" and experts // int(n_group) < 2:
            raise ModelFileError(f"{source}: n_group {n_group} leaves fewer than 2 experts per group (groups rank "
                                 f"by their top-2 sum)")
        if get("num_experts_per_tok") is None:
            raise ModelFileError(f"{source}: missing required key 'num_experts_per_tok'")
        eos = cfg.get("eos_token_id")
        q_lora = cfg.get("q_lora_rank", _DEFAULTS[arch]["q_lora_rank"])  # null is meaningful: no q LoRA
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
            num_heads=heads, q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")),
            first_k_dense_replace=int(get("first_k_dense_replace")), n_routed_experts=experts,
            n_shared_experts=int(get("n_shared_experts")), num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")), topk_method=topk_method,
            n_group=int(n_group), topk_group=int(topk_group), scoring_func=get("scoring_func"),
            norm_topk_prob=bool(get("norm_topk_prob")), routed_scaling_factor=float(get("routed_scaling_factor")),
            rope=_rope_of(cfg, source),
            rope_layout="complex" if arch == "deepseek_v2" else ("interleave" if get("rope_interleave") else "half"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any], infos: dict[str, Any], tokenizer: Any) -> "DeepseekConfig":
        """The config of a llama.cpp `deepseek2` file, read as llama.cpp reads it: the main layers
        block_count - nextn_predict_layers (the multi-token-prediction layers after them are not run);
        gating by expert_gating_func (absent or 0: softmax, llama.cpp's rule for DeepSeek-V2 files, but
        for GLM-4.7-Flash's shape, sigmoid; sigmoid is V3's router, with the correction bias exp_probs_b
        where the file has one), groups when expert_group_count > 1 (ranked by their top-2 sum under
        sigmoid, by their best expert under softmax: DeepSeek-V2's own rule, which transformers follows;
        llama.cpp ranks both by the top-2 sum), the rotary pairs adjacent (ggml's NORM rope), YaRN
        with mscale = mscale_all_dim (the file has only the latter, as rope.scaling.yarn_log_multiplier
        = 0.1 · mscale_all_dim) and betas 32 / 1 (llama.cpp's deepseek2 does not read the file's)."""
        def get(key: str, default: Any = None, required: bool = False) -> Any:
            value = meta.get(f"deepseek2.{key}", default)
            if required and value is None:
                raise ModelFileError(f"missing metadata key deepseek2.{key!r}")
            if isinstance(value, list):
                raise UnsupportedModelError(f"deepseek2.{key} per layer ({value[:4]}...) is not supported")
            return value

        for key, off in (("attention.temperature_scale", 0), ("rope.scaling.yarn_ext_factor", 1),
                         ("rope.scaling.yarn_attn_factor", 1), ("rope.scaling.attn_factor", 1)):
            if get(key) not in (None, off):
                raise UnsupportedModelError(f"deepseek2.{key}={get(key)} is not supported")
        layers = int(get("block_count", required=True)) - int(get("nextn_predict_layers") or 0)
        heads = int(get("attention.head_count", required=True))
        embd = infos.get("token_embd.weight")
        vocab = int(get("vocab_size") or (embd.shape[-1] if embd is not None else len(meta["tokenizer.ggml.tokens"])))
        gating = get("expert_gating_func") or None
        if gating is None and layers in (47, 48) and vocab == 154880:  # GLM-4.7-Flash (llama.cpp's rule)
            gating = 2
        if gating not in (None, 1, 2):
            raise UnsupportedModelError(f"deepseek2.expert_gating_func={gating} is not supported "
                                        f"(1 softmax, 2 sigmoid)")
        sigmoid = gating == 2
        n_group, topk_group = int(get("expert_group_count") or 1), int(get("expert_group_used_count") or 1)
        experts = int(get("expert_count", required=True))
        if experts % n_group or not 0 < topk_group <= n_group or (n_group > 1 and sigmoid and experts // n_group < 2):
            raise ModelFileError(f"deepseek2.expert_group_count {n_group} / expert_group_used_count {topk_group} do "
                                 f"not fit {experts} experts")
        r, dr = int(get("attention.kv_lora_rank", required=True)), int(get("rope.dimension_count", required=True))
        if get("attention.key_length_mla") is not None:  # files since llama.cpp's MLA cache (2025)
            dk, dv = int(get("attention.key_length_mla")), int(get("attention.value_length_mla", required=True))
        else:  # older files: the per-head lengths in key_length / value_length
            dk, dv = int(get("attention.key_length", required=True)), int(get("attention.value_length", required=True))
        q_lora = int(get("attention.q_lora_rank") or 0) or None  # 0 / absent: q straight from the hidden state
        ctx = int(get("context_length", 4096))
        theta = float(get("rope.freq_base", 10000.0))
        scaling = get("rope.scaling.type")
        if scaling is None and get("rope.scaling.factor") not in (None, 1, 1.0):
            raise UnsupportedModelError(f"deepseek2.rope.scaling.factor={get('rope.scaling.factor')} without "
                                        f"rope.scaling.type (llama.cpp reads it as linear scaling) is not supported")
        if scaling == "yarn":
            log_mul = get("rope.scaling.yarn_log_multiplier")
            if not log_mul:  # llama.cpp then scales the logits by (1 + 0.1 ln factor)², transformers does not
                raise UnsupportedModelError("deepseek2 YaRN without rope.scaling.yarn_log_multiplier is not supported")
            mscale_all = float(log_mul) / 0.1
            rope = DeepseekRope(theta=theta, rope_type="yarn", factor=float(get("rope.scaling.factor", required=True)),
                                original_max_position_embeddings=int(get("rope.scaling.original_context_length", ctx)),
                                beta_fast=32.0, beta_slow=1.0, mscale=mscale_all, mscale_all_dim=mscale_all)
        elif scaling in (None, "none"):
            rope = DeepseekRope(theta=theta)
        else:
            raise UnsupportedModelError(f"deepseek2.rope.scaling.type {scaling!r} is not supported (none, yarn)")
        if dk <= dr:
            raise ModelFileError(f"key length {dk} leaves no non-rotary dims beside {dr} rotary ones")
        return cls(
            architecture="deepseek_v3" if sigmoid else "deepseek_v2", vocab_size=vocab,
            hidden_size=int(get("embedding_length", required=True)),
            intermediate_size=int(get("feed_forward_length", required=True)), num_layers=layers, num_heads=heads,
            q_lora_rank=q_lora, kv_lora_rank=r, qk_nope_head_dim=dk - dr,
            qk_rope_head_dim=dr, v_head_dim=dv, first_k_dense_replace=int(get("leading_dense_block_count", 0)),
            n_routed_experts=experts, n_shared_experts=int(get("expert_shared_count", required=True)),
            num_experts_per_tok=int(get("expert_used_count", required=True)),
            moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
            topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
            n_group=n_group, topk_group=topk_group, scoring_func="sigmoid" if sigmoid else "softmax",
            norm_topk_prob=bool(get("expert_weights_norm", False)),
            routed_scaling_factor=float(get("expert_weights_scale") or 1.0), rope=rope, rope_layout="interleave",
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in infos, max_position_embeddings=ctx,
            bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
        )


def _refuse_unsupported(cfg: dict[str, Any], arch: str, source: str) -> None:
    """An UnsupportedModelError naming the first key whose value this model does not implement."""
    d = _DEFAULTS[arch]

    def refuse(key: str, why: str) -> None:
        raise UnsupportedModelError(f"{source}: {key}={cfg.get(key)!r} is not supported for {arch} ({why})")

    if cfg.get("quantization_config"):
        refuse("quantization_config", "load a float checkpoint (bfloat16 / float32) or a GGUF file")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse("hidden_act", "supported: 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            refuse(key, "DeepSeek checkpoints carry no biases; this model has no place for them")
    if cfg.get("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", "every layer from first_k_dense_replace on is MoE, as transformers builds it")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != cfg.get("num_attention_heads"):
        refuse("num_key_value_heads", f"MLA has one latent per token; must equal num_attention_heads "
                                      f"({cfg.get('num_attention_heads')})")
    if cfg.get("n_shared_experts", d["n_shared_experts"]) in (None, 0):
        refuse("n_shared_experts", "at least one shared expert")
    scoring, method = cfg.get("scoring_func") or d["scoring_func"], cfg.get("topk_method") or d["topk_method"]
    if arch == "deepseek_v2":
        if scoring != "softmax":
            refuse("scoring_func", "deepseek_v2 routes by softmax, as transformers does")
        if method not in ("greedy", "group_limited_greedy"):
            refuse("topk_method", "deepseek_v2: 'greedy' or 'group_limited_greedy'")
        if cfg.get("norm_topk_prob"):
            refuse("norm_topk_prob", "transformers' deepseek_v2 ignores it, DeepSeek's own code normalizes: ambiguous")
    else:
        if scoring != "sigmoid":
            refuse("scoring_func", "deepseek_v3 routes by sigmoid with the correction bias, as transformers does")
        if method != "noaux_tc":
            refuse("topk_method", "deepseek_v3: 'noaux_tc'")
    if cfg.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        refuse("partial_rotary_factor", "the whole qk_rope_head_dim is rotary")


def _rope_of(cfg: dict[str, Any], source: str) -> DeepseekRope:
    """rope_theta plus `rope_scaling` (older files) or `rope_parameters` (transformers 5)."""
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise UnsupportedModelError(f"{source}: rope type {rope_type!r} is not supported for DeepSeek "
                                    f"(supported: 'default', 'yarn')")
    if merged.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{source}: partial_rotary_factor={merged['partial_rotary_factor']!r} is not "
                                    f"supported (the whole qk_rope_head_dim is rotary)")
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return DeepseekRope(theta=theta)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    original = int(merged.get("original_max_position_embeddings") or max_pos)
    factor = merged.get("factor")
    return DeepseekRope(
        theta=theta, rope_type="yarn", factor=float(factor) if factor is not None else max_pos / original,
        original_max_position_embeddings=original, beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1), mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"), attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


class LatentAttention(Protocol):
    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int,
                      scale: float) -> torch.Tensor:
        """q [T, h, Dk] (absorbed queries of the new tokens), latent [T, Dk] (their latents, to store)
        -> [T, h, v_dim]: softmax(scale · q·latentᵀ) over each token's causal context, times the
        context latents' first v_dim dims."""
        ...


class Rotary:
    """The rotary part of q and k in the checkpoint's own layout (`DeepseekConfig.rope_layout`)."""

    def __init__(self, rope: DeepseekRope, dim: int, layout: str, device: torch.device) -> None:
        self.inv_freq = rope.inv_freq(dim).to(device)  # [dim/2]
        self.factor, self.layout = rope.cos_sin_factor(), layout

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-position tables: (freqs_cis [T, dim/2] complex,) or (cos, sin) [T, dim/2] ("interleave")
        or [T, dim] ("half"), scaled by the cos/sin factor and cast to the model dtype."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, dim/2]
        if self.layout == "complex":
            return (torch.polar(torch.ones_like(freqs), freqs) * self.factor,)
        emb = torch.cat((freqs, freqs), dim=-1) if self.layout == "half" else freqs
        return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, heads, dim] rotated by its position's tables (each [T, ...] broadcast over heads)."""
        if self.layout == "complex":  # pairs (x0, x1), (x2, x3), ... as complex numbers; the output stays paired
            xc = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * tables[0].unsqueeze(1)).flatten(-2).type_as(x)
        cos, sin = (t.unsqueeze(1) for t in tables)
        if self.layout == "interleave":  # pairs (x0, x1), ...; written out as [evens' ; odds']
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MLA:
    """One layer's multi-head latent attention, absorbed."""

    def __init__(self, c: DeepseekConfig, reader: _WeightReader, pre: str, product, rows) -> None:
        self.c, self.product, self.rows = c, product, rows  # rows: moe.dense_rows_for
        if c.q_lora_rank is None:  # q and the latent from the hidden state in one product
            self.q_kv_a = reader.matrix(pre + "q_proj.weight", pre + "kv_a_proj_with_mqa.weight")  # [H, h·dq + Dk]
            self.q_a_norm = self.q_b = None
        else:
            self.q_kv_a = reader.matrix(pre + "q_a_proj.weight", pre + "kv_a_proj_with_mqa.weight")  # [H, q_rank + Dk]
            self.q_a_norm = reader.take(pre + "q_a_layernorm.weight")
            self.q_b = reader.matrix(pre + "q_b_proj.weight")  # [q_rank, h·dq]
        self.kv_a_norm = reader.take(pre + "kv_a_layernorm.weight")  # [r]
        kv_b = reader.take(pre + "kv_b_proj.weight").float()  # [h·(dn + dv), r]
        if kv_b.shape != (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank):
            raise ModelFileError(f"{pre}kv_b_proj.weight has shape {tuple(kv_b.shape)}, config says "
                                 f"{(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)}")
        kv_b = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk_t = kv_b[:, : c.qk_nope_head_dim].transpose(1, 2).contiguous()  # W_UK per head, [h, r, dn] float32
        self.w_uv = kv_b[:, c.qk_nope_head_dim :].contiguous()  # [h, dv, r] float32
        self.o = reader.matrix(pre + "o_proj.weight")  # [h·dv, H]

    def project(self, x: torch.Tensor, rotary: Rotary, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] (normed) -> q_nope [T, h, dn], q_pe [T, h, dr] (rotated), latent [T, Dk] = [norm(c_kv) ; k_pe]."""
        c, T = self.c, x.shape[0]
        q_kv = self.product(x, self.q_kv_a)
        split = q_kv.shape[1] - c.latent_dim
        q, kv = q_kv[:, :split], q_kv[:, split:]
        if self.q_b is not None:
            q = self.product(rms_norm(q.contiguous(), self.q_a_norm, _LATENT_NORM_EPS), self.q_b)
        q = q.view(T, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], rotary.apply(q[..., c.qk_nope_head_dim :], tables)
        c_kv = rms_norm(kv[:, : c.kv_lora_rank].contiguous(), self.kv_a_norm, _LATENT_NORM_EPS)  # [T, r]
        k_pe = rotary.apply(kv[:, None, c.kv_lora_rank :], tables)[:, 0]  # [T, dr]
        return q_nope, q_pe, torch.cat([c_kv, k_pe], dim=-1)

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[q_nope · W_UK ; q_pe] [T, h, Dk]: the nope part moved into the latent space per head."""
        q_lat = self.rows(q_nope.float(), self.w_uk_t).to(q_pe.dtype)  # [T, h, r]
        return torch.cat([q_lat, q_pe], dim=-1)

    def heads(self, x: torch.Tensor, layer: int, rotary: Rotary, tables, attention: LatentAttention) -> torch.Tensor:
        """x [T, H] (normed) -> the heads' values [T, h, dv], before o_proj."""
        q_nope, q_pe, latent = self.project(x, rotary, tables)
        q = self.absorbed_query(q_nope, q_pe)
        o_lat = attention.attend_latent(layer, q, latent, self.c.kv_lora_rank, self.c.softmax_scale)  # [T, h, r]
        return self.rows(o_lat.float(), self.w_uv).to(x.dtype)  # W_UV per head

    def __call__(self, x: torch.Tensor, layer: int, rotary: Rotary, tables, attention: LatentAttention) -> torch.Tensor:
        a = self.heads(x, layer, rotary, tables, attention)  # [T, h, dv]
        return self.product(a.reshape(x.shape[0], -1), self.o)  # [T, H]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [S, Dk] -> per-head k [S, h, dn + dr] = [W_UK·c ; k_pe], v [S, h, dv] = W_UV·c: the
        standard attention's K/V (a prefill may attend over these instead of absorbing)."""
        c = self.c
        c_kv, k_pe = latent[:, : c.kv_lora_rank].float(), latent[:, c.kv_lora_rank :]
        k_nope = torch.einsum("sr,hrd->shd", c_kv, self.w_uk_t).to(latent.dtype)
        v = torch.einsum("sr,hvr->shv", c_kv, self.w_uv).to(latent.dtype)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, c.num_heads, -1)], dim=-1)
        return k, v


class DeepseekModel:
    """Weights plus a forward pass. Every tensor of the checkpoint is used or refused by name, but for
    the multi-token-prediction layers (index >= num_hidden_layers), which plain decoding does not run."""

    def __init__(self, config: DeepseekConfig, weights: dict[str, torch.Tensor], backend: Backend) -> None:
        self.config, self.backend = config, backend
        backend.for_model(config.latent_dim)  # the decode attention kernel for one latent "KV head" of width Dk
        self.dtype, self.device = backend.dtype, backend.device
        self.num_valid_tokens = config.vocab_size
        self.product = product_for(backend)
        self.rows = dense_rows_for(backend)  # the router's and W_UK / W_UV's float32 products, row-independent
        _split_fused_experts(weights, config)
        mtp = [n for n in weights if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m[1]) >= config.num_layers]
        for n in mtp:
            del weights[n]
        reader = _WeightReader(weights, backend)
        tied = not ("lm_head.weight" in weights and not config.tie_word_embeddings)
        self.embed, self._embed_rows, tied_head = token_table(reader, (config.vocab_size, config.hidden_size), tied)
        self.layers = [self._build_layer(reader, i) for i in range(config.num_layers)]
        self.norm = reader.take("model.norm.weight")
        if not tied:
            self.lm_head = reader.matrix("lm_head.weight", how=head_format(backend.quantize))  # [H, V] ("in_out")
        else:
            weights.pop("lm_head.weight", None)
            if tied_head is not None and not isinstance(tied_head, torch.Tensor):
                self.lm_head = tied_head
            else:
                self.lm_head = reader.transposed(self.embed) if backend.weight_layout == "in_out" else self.embed
        self.rotary = Rotary(config.rope, config.qk_rope_head_dim, config.rope_layout, self.device)
        unused = sorted(n for n in weights if not n.endswith("rotary_emb.inv_freq"))
        if unused:
            more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
            raise UnsupportedModelError(f"checkpoint has tensors a {config.architecture} model does not use: "
                                        f"{', '.join(unused[:5])}{more}")

    def named_matrices(self):
        """(kind, weight) of every product's weights, layer by layer: attention, MLP / experts."""
        for layer in self.layers:
            attn, mlp = layer["attn"], layer["mlp"]
            yield from (("q_kv_a" if attn.q_b is None else "q_a_kv_a", attn.q_kv_a), ("o", attn.o))
            if attn.q_b is not None:
                yield "q_b", attn.q_b
            if isinstance(mlp, MoE):
                for expert in mlp.experts:
                    yield from (("expert gate_up", expert.gate_up), ("expert down", expert.down))
                yield from (("shared gate_up", mlp.shared.gate_up), ("shared down", mlp.shared.down))
            else:
                yield from (("gate_up", mlp.gate_up), ("down", mlp.down))

    def _small_tensors(self) -> list[torch.Tensor]:
        """The tensors outside the products: norms, W_UK / W_UV (float32), the routers (float32)."""
        out = [self.norm]
        for layer in self.layers:
            attn, mlp = layer["attn"], layer["mlp"]
            out += [layer["attn_norm"], layer["mlp_norm"], attn.kv_a_norm, attn.w_uk_t, attn.w_uv]
            out += [attn.q_a_norm] if attn.q_a_norm is not None else []
            if isinstance(mlp, MoE):
                out += [mlp.router.weight] + ([mlp.router.bias] if mlp.router.bias is not None else [])
        return out

    def num_weight_bytes(self) -> int:
        """Bytes of every weight the model holds (a tensor shared by two uses counted once)."""
        from forklm.models.quant import QuantizedLinear

        held = [w for _, w in self.named_matrices()] + [self.lm_head] + self._small_tensors()
        held += [self.embed] if self.embed is not None else []
        tensors = [t for w in held for t in (w.tensors() if isinstance(w, QuantizedLinear) else [w])]
        unique = {t.data_ptr(): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def step_weight_bytes(self, rows: int) -> float:
        """Weight bytes a forward of `rows` rows reads: every weight but the routed experts once (in
        the form that runs at that many rows, as LlamaModel.step_weight_bytes), and of each MoE layer's
        routed experts the expected number `rows` tokens touch under uniform routing,
        E·(1 - (1 - k/E)^rows) (an estimate: the routing is the model's)."""
        from forklm.models.llama import weight_bytes_read

        total = sum(weight_bytes_read(w, rows) for w in [self.lm_head] + self._small_tensors())
        total += sum(weight_bytes_read(w, rows) for name, w in self.named_matrices() if not name.startswith("expert "))
        c = self.config
        touched = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** rows)
        for layer in self.layers:
            if isinstance(layer["mlp"], MoE):
                experts = layer["mlp"].experts
                per_expert = sum(weight_bytes_read(e.gate_up, rows) + weight_bytes_read(e.down, rows)
                                 for e in experts) / len(experts)
                total += touched * per_expert
        return total

    def prepare_decode_stack(self) -> None:
        """Llama's one-call C++ layer stack has no latent form: DeepSeek layers run one by one."""

    def _build_layer(self, reader: _WeightReader, i: int) -> dict:
        c, pre = self.config, f"model.layers.{i}."
        return {
            "attn_norm": reader.take(pre + "input_layernorm.weight"),
            "attn": MLA(c, reader, pre + "self_attn.", self.product, self.rows),
            "mlp_norm": reader.take(pre + "post_attention_layernorm.weight"),
            "mlp": self._build_moe(reader, pre + "mlp.") if c.is_moe_layer(i) else self._swiglu(reader, pre + "mlp."),
        }

    def _swiglu(self, reader: _WeightReader, pre: str) -> SwiGLU:
        return SwiGLU(reader.matrix(pre + "gate_proj.weight", pre + "up_proj.weight"),
                      reader.matrix(pre + "down_proj.weight"), self.product)

    def _build_moe(self, reader: _WeightReader, pre: str) -> MoE:
        c = self.config
        bias = reader.raw(pre + "gate.e_score_correction_bias") if c.scoring_func == "sigmoid" else None
        router = Router(reader.raw(pre + "gate.weight"), bias, top_k=c.num_experts_per_tok, scoring=c.scoring_func,
                        topk_method=c.topk_method, n_group=c.n_group, topk_group=c.topk_group,
                        norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor, rows=self.rows)
        if router.weight.shape != (c.n_routed_experts, c.hidden_size):
            raise ModelFileError(f"{pre}gate.weight has shape {tuple(router.weight.shape)}, config says "
                                 f"{(c.n_routed_experts, c.hidden_size)}")
        experts = [self._swiglu(reader, f"{pre}experts.{e}.") for e in range(c.n_routed_experts)]
        return MoE(router, experts, self._swiglu(reader, pre + "shared_experts."))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attention: LatentAttention,
        logits_rows: torch.Tensor | None = None,  # which of the T rows need logits; None: all
    ) -> torch.Tensor:  # [len(logits_rows) or T, V] float32
        eps = self.config.rms_norm_eps
        x = embed_tokens(self.embed, self._embed_rows, input_ids, self.dtype)  # [T, H]
        tables = self.rotary.tables(positions, self.dtype)
        for i, layer in enumerate(self.layers):
            x = x + layer["attn"](rms_norm(x, layer["attn_norm"], eps), i, self.rotary, tables, attention)
            x = x + layer["mlp"](rms_norm(x, layer["mlp_norm"], eps))
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self.product(rms_norm(x, self.norm, eps), self.lm_head).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        return logits


def _split_fused_experts(weights: dict, c: DeepseekConfig) -> None:
    """transformers' in-memory layout, experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I],
    rewritten as the per-expert tensors checkpoints store (experts.{e}.gate_proj.weight, ...)."""
    for name in [n for n in weights if n.endswith("mlp.experts.gate_up_proj")]:
        pre = name[: -len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(pre + "down_proj", None)
        if down is None:
            raise ModelFileError(f"checkpoint has {name} but no {pre}down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            weights[f"{pre}{e}.gate_proj.weight"] = gate_up[e, :inter]
            weights[f"{pre}{e}.up_proj.weight"] = gate_up[e, inter:]
            weights[f"{pre}{e}.down_proj.weight"] = down[e]
