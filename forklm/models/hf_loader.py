"""Loads a Hugging Face model folder: config.json, *.safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from forklm.config import ModelConfig, read_json_object
from forklm.errors import ModelFileError


def load_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by name, following a sharded index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFileError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if bins:
            return _load_torch_bins(bins)
        raise FileNotFoundError(f"{folder}: no *.safetensors or pytorch_model*.bin weights found")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f"{path}: weight shard named in the index is missing")
        try:
            weights.update(load_file(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot read safetensors file ({e})") from None
    return weights


def _load_torch_bins(paths: list[Path]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:  # torch raises many types for a bad pickle
            raise ModelFileError(f"{path}: cannot read PyTorch weights ({type(e).__name__}: {e})") from None
    return weights


def read_hf_config(path: Path):
    """config.json as forklm's config for its architecture: DeepseekConfig for DeepSeek-V2 / V3 (latent
    attention, models/deepseek.py), GPT2Config for GPT-2 / GPT-BigCode (models/gpt2.py), else
    ModelConfig (Llama-family and Qwen2)."""
    from forklm.models.deepseek import ARCHITECTURES as DEEPSEEK, DeepseekConfig
    from forklm.models.gpt2 import ARCHITECTURES as GPT2, GPT2Config

    cfg = read_json_object(path)
    if cfg.get("model_type") in DEEPSEEK:
        return DeepseekConfig.from_hf_dict(cfg, source=str(path))
    if cfg.get("model_type") in GPT2:
        return GPT2Config.from_hf_dict(cfg, source=str(path))
    return ModelConfig.from_hf_dict(cfg, source=str(path))


def load_hf_folder(folder: Path):
    """(config, weights, Tokenizer) from a Hugging Face model folder (`read_hf_config`)."""
    from forklm.tokenizer import Tokenizer

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: a Hugging Face model folder needs config.json")
    config = read_hf_config(config_path)
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelFileError(f"{gen_path}: not valid JSON ({e})") from None
        eos = gen.get("eos_token_id")
        extra = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if extra:
            from dataclasses import replace

            config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
    weights = load_hf_weights(folder)
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"{folder / 'tokenizer.json'}: the model folder has no tokenizer.json")
    tokenizer = Tokenizer.from_hf_folder(folder)
    return config, weights, tokenizer
