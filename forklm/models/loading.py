"""Loading a model as the user names it: its files (or random weights), the backend resolved once
for them (forklm/backend.py), the model built on it. `LLM` and a speculative draft both load here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forklm.backend import Backend, keeps_half_matrices, loader_keeps_gguf_blocks, resolve_quantize
from forklm.device import resolve_device, resolve_dtype
from forklm.kernels.ggml_gemm import GGMLWeights
from forklm.models.deepseek import DeepseekConfig, DeepseekModel
from forklm.models.gpt2 import GPT2Config, GPT2Model
from forklm.models.llama import LlamaModel
from forklm.models.quant import BlockQuantized, half_matrices_as_stored
from forklm.models.random_weights import PREFIX as RANDOM_PREFIX
from forklm.models.random_weights import random_config, random_weights
from forklm.models.registry import load_model_files


@dataclass
class LoadedModel:
    model: LlamaModel | DeepseekModel | GPT2Model
    tokenizer: Any  # forklm.tokenizer.Tokenizer, or None for random weights
    source: str | Path


def load_model(model: str | Path, *, dtype="auto", device="auto", quantize="auto") -> LoadedModel:
    """A model name / HF folder / .gguf file (or "random:<shape>": random weights drawn on the device,
    for benchmarks) on the backend resolved for it. The fall-backs from the fast path the backend
    takes are shown once, as a warning naming the model."""
    if isinstance(model, str) and model.lower().startswith(RANDOM_PREFIX):
        dev = resolve_device(device)
        config = random_config(model)
        weights = random_weights(config, resolve_dtype(dtype, dev), dev)
        tokenizer, source = None, model
    else:
        dev = resolve_device(device)
        resolve_quantize(quantize, resolve_dtype(dtype, dev), dev)  # the arguments checked before any file is read
        keep = loader_keeps_gguf_blocks(quantize)
        config, weights, tokenizer, source = load_model_files(model, keep_quantized=keep)
    model_class = {DeepseekConfig: DeepseekModel, GPT2Config: GPT2Model}.get(type(config), LlamaModel)
    if model_class is LlamaModel and Path(str(source)).is_dir() and keeps_half_matrices(dtype, device, quantize):
        weights = half_matrices_as_stored(weights) or weights  # a bfloat16 / float16 folder: its matrices as stored
    has_blocks = any(isinstance(w, (BlockQuantized, GGMLWeights)) for w in weights.values())
    backend = Backend.resolve(dtype=dtype, device=device, quantize=quantize, has_gguf_blocks=has_blocks)
    built = model_class(config, weights, backend)
    del weights
    if backend.fallbacks:
        warnings.warn(f"forklm: {Path(str(source)).name}: " + "; ".join(backend.fallbacks) + " (see `forklm info`)",
                      RuntimeWarning, stacklevel=3)
    return LoadedModel(built, tokenizer, source)
