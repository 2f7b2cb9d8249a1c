"""Random-weight models for benchmarks (like vLLM's dummy load format): a model of a real shape,
built directly on the device, without files. Never the default; `LLM("random:llama3-8b")`.

A shape is a name in `NAMED_SHAPES`, a config.json path (or a folder holding one), or a dict in
config.json's keys. Weights are drawn as Hugging Face initializes them (normal, std 0.02; norms
one), on the target device in the target dtype, under a seed. Such a model has no tokenizer:
prompts are token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from forklm.config import ModelConfig
from forklm.errors import InvalidArgumentError

PREFIX = "random:"

NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128009],
    },
    "llama3-8b-mha": {  # the same with g = h = 32 (multi-head attention): the MHA benchmark shape
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
}


def random_config(shape: str | Path | dict) -> ModelConfig:
    if isinstance(shape, dict):
        return ModelConfig.from_hf_dict(shape, source="random shape")
    text = str(shape)
    if text.startswith(PREFIX):
        text = text[len(PREFIX) :]
    if text in NAMED_SHAPES:
        return ModelConfig.from_hf_dict(NAMED_SHAPES[text], source=f"{PREFIX}{text}")
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_json_file(path)
    raise InvalidArgumentError(
        f"unknown random shape {text!r}: give one of {sorted(NAMED_SHAPES)} or a config.json path"
    )


def random_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Tensors named as in a Hugging Face checkpoint of `config`, drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * std

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    H, D = c.hidden_size, c.head_dim
    w = {"model.embed_tokens.weight": normal(c.vocab_size, H), "model.norm.weight": ones(H)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = normal(c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(H)
        w[p + "post_attention_layernorm.weight"] = ones(H)
        for name, rows in (("q", c.num_heads * D), ("k", c.num_kv_heads * D), ("v", c.num_kv_heads * D)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(rows, H)
            if c.attention_bias:
                w[p + f"self_attn.{name}_proj.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(H, c.num_heads * D)
        if c.o_proj_bias:
            w[p + "self_attn.o_proj.bias"] = normal(H)
        for name, (rows, cols) in (("gate", (c.intermediate_size, H)), ("up", (c.intermediate_size, H)),
                                   ("down", (H, c.intermediate_size))):
            w[p + f"mlp.{name}_proj.weight"] = normal(rows, cols)
            if c.mlp_bias:
                w[p + f"mlp.{name}_proj.bias"] = normal(rows)
    return w


def random_model(shape: str | Path | dict, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    from forklm.backend import Backend
    from forklm.models.llama import LlamaModel

    config = random_config(shape)
    device = torch.device(device)
    return LlamaModel(config, random_weights(config, dtype, device, seed), Backend.exact(dtype, device))
