"""Model configuration: one frozen dataclass, built from config.json (any vintage) or GGUF metadata.

Supported architectures are the Llama family (MHA, GQA, MQA; Llama-3 RoPE scaling; tied or
untied embeddings; optional attention and MLP biases) and Qwen2 (q/k/v biases). Everything else
is rejected with an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forklm.errors import ModelFileError, UnsupportedModelError

# HF `architectures[0]` / `model_type` -> our family name.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # same math when sliding_window is unset
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalized from the several spellings found in config.json."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of _ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2: always), and o too (Llama only)
    mlp_bias: bool = False  # gate/up/down projections carry biases (Llama only)
    dtype: str | None = None  # dtype the checkpoint was saved in, if it says
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelFileError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias: Llama's attention_bias covers it, Qwen2's not."""
        return self.attention_bias and self.architecture == "llama"

    kv_shares_values = False  # the cache's values are its keys' first dims (latent attention: DeepseekConfig)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of K and V one token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        arch = _architecture_of(cfg, source)
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            intermediate = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ModelFileError(f"{source}: missing required key {e.args[0]!r}") from None
        num_kv = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise UnsupportedModelError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (supported: 'silu')")
        if arch == "llama" and cfg.get("sliding_window") not in (None, 0) and cfg.get("model_type") == "mistral":
            raise UnsupportedModelError(f"{source}: sliding-window attention (Mistral) is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_of(cfg, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # as transformers builds them: Qwen2 always has q/k/v biases and never MLP biases
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        return cls.from_hf_dict(read_json_object(path), source=str(path))


def read_json_object(path: Path) -> dict[str, Any]:
    """A config file's JSON object; ModelFileError for invalid JSON or anything but an object."""
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return cfg


def _architecture_of(cfg: dict[str, Any], source: str) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in _ARCHITECTURES:
            return _ARCHITECTURES[a]
    mt = cfg.get("model_type")
    if not archs and mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt]
    name = archs[0] if archs else mt
    supported = ", ".join(sorted(_ARCHITECTURES)) + "; and model_type deepseek_v2 / deepseek_v3 (Hugging Face folders)"
    raise UnsupportedModelError(f"{source}: unsupported architecture {name!r} (supported: {supported})")


def _rope_of(cfg: dict[str, Any], source: str) -> RopeConfig:
    """Reads rope settings from either `rope_parameters` (newer) or `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope type {rope_type!r} (supported: {', '.join(_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
