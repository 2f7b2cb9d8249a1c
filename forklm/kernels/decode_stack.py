"""A decode step's transformer layers in one C++ call (csrc/decode_stack.cpp), for float32 Llama
models whose layers all run on the block kernel, on steps that run the C++ attention.

Why: on such a step the model's Python loop makes ~150 calls into C++ (four block-kernel products
and one attention call per layer), each with its Python wrappers around it: ~1 ms of a 7 ms step
at one sample. The stack makes the same calls with the same arguments from C++ (the two kernels'
sources compiled into one module), so its output equals the loop's bit for bit.

    stack = build(model)                # None when the model or this machine does not qualify
    x = attention.run_layers(stack, x, cos, sin)   # PagedAttention passes its caches and plan

FORKLM_DECODE_STACK=0 in the environment turns it off (the Python loop then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from forklm.kernels import block_gemm, cpu_attention
from forklm.kernels.block_gemm import cpu_extension_error

_SOURCE = Path(__file__).parent / "csrc" / "decode_stack.cpp"


@lru_cache(maxsize=1)
def _extension():  # the block kernel's build (AVX2 or AVX512-VNNI), as its own module
    return block_gemm.load_block_kernel_build("forklm_decode_stack", _SOURCE)


@lru_cache(maxsize=1)
def build_error() -> str | None:
    """None when the stack is built and loaded (building it on first call), else why not."""
    if os.environ.get("FORKLM_DECODE_STACK", "1") == "0":
        return "disabled by FORKLM_DECODE_STACK=0"
    for name, kernel in (("block kernel", block_gemm), ("C++ attention", cpu_attention)):
        if kernel.build_error() is not None:
            return f"the {name} does not run here: {kernel.build_error()}"
    return cpu_extension_error(_extension, "decode stack")


def available() -> bool:
    return build_error() is None


@dataclass
class DecodeStack:
    kernel: object  # the C++ DecodeStack: the layers' norms and block matrices
    max_rows: int  # the most rows a step may have to run on it (every product's kernel limit)
    weights: tuple = ()  # the layers' BlockLinears, held while the stack lives (stored Q8_0 hands it addresses only)


LAYER_MATRICES = ("qkv", "o", "gate_up", "down")


def _on_block_kernel(w) -> bool:
    """Whether a model's product runs on the block kernel (a `BlockLinear`: its parts `BlockWeights`)."""
    parts = getattr(w, "parts", None)
    return bool(parts) and all(isinstance(p, block_gemm.BlockWeights) for p in parts)


def unsupported_reason(model) -> str | None:
    """None where a Llama-type model (`forklm.models.llama.LlamaModel`) can run every layer on the stack
    (float32, every layer product on the block kernel; q/k/v biases as Qwen2 has, no other biases),
    else why not (the kernel's own build aside)."""
    if model.dtype != torch.float32:
        return f"it runs float32 models, this one is {model.dtype}"
    for i, layer in enumerate(model.layers):
        for n in LAYER_MATRICES:
            if not _on_block_kernel(layer[n]):
                stored = getattr(layer[n], "stored_types", None)
                return f"layer {i}'s {n} does not run on the block kernel" + (f" ({'+'.join(stored)})" if stored else "")
        if any(layer.get(f"{n}_bias") is not None for n in ("o", "gate_up", "down")):
            return f"layer {i} has biases besides q/k/v"
        if layer.get("qkv_bias") is not None and layer["qkv_bias"].dtype != torch.float32:
            return f"layer {i}'s q/k/v bias is not float32"
    return None


def build(model) -> DecodeStack | None:
    """The stack for a model `unsupported_reason` accepts, where the kernel builds, else None."""
    if unsupported_reason(model) is not None or not available():  # (built here on first use: only for models that qualify)
        return None
    names = LAYER_MATRICES
    mats = [layer[n] for layer in model.layers for n in names]
    kernel = _extension().DecodeStack(
        [t for layer in model.layers for t in (layer["attn_norm"], layer["mlp_norm"])],
        [[p.kind for p in w.parts] for w in mats], [[list(p.kernel_arrays()) for p in w.parts] for w in mats],
        float(model.config.rms_norm_eps), model.config.num_heads, [layer.get("qkv_bias") for layer in model.layers],
    )
    return DecodeStack(kernel, min(w.max_rows for w in mats), tuple(mats))
