"""`forklm info`: what this machine and a model get, in one place: the CPU features forklm's rules
see, each native kernel built or why not, and per weight of the model its stored type, the kernel
and layout it runs on, dtype and memory."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from forklm.device import cpu_flags, cpu_model

FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def kernels_report() -> dict[str, str]:
    """Each native kernel: "built" (and which build) or why it does not run here."""
    from forklm.kernels import block_gemm, cpu_attention, cpu_sampler, decode_stack, ggml_gemm
    from forklm.models.gguf_file import string_reader_error

    def state(err: str | None, built: str = "built") -> str:
        return built if err is None else f"not available: {err}"

    build = block_gemm.LOADED_BUILDS.get("forklm_block_gemm", "?") if block_gemm.build_error() is None else "?"
    if build == "AVX512-VNNI" and block_gemm.cpu_has_amx():
        ext = block_gemm._extension()
        build += (f", AMX tiles at {ext.AMX_MIN_ROWS}-{ext.AMX_MAX_ROWS} rows" if block_gemm.uses_amx()
                  else ", AMX tiles off (FORKLM_BLOCK_KERNEL_AMX=0 or Linux refused the tile data)")
        if block_gemm.uses_amx_bf16():
            build += ", BF16 on AMX-BF16 tiles at every row count (float32 activations split in three bfloat16 parts)"
    block = state(block_gemm.build_error(), f"built ({build})")
    return {
        "block kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16, F16)": block,
        "ggml dot products (every other GGUF type)": state(ggml_gemm.build_error(), f"built ({ggml_gemm.ggml_dir()})"),
        "C++ attention": state(cpu_attention.build_error(),
                               "built (AVX-512 tiles at many query rows)" if cpu_attention.loaded_build() == "AVX512-VNNI"
                               else "built (AVX2)"),
        "C++ sampler": state(cpu_sampler.build_error()),
        "decode stack": state(decode_stack.build_error()),
        "GGUF string reader (vocabulary at load)": state(string_reader_error()),
    }


def _placement(w: Any) -> str:
    from forklm.models.quant import BlockLinear, GGMLLinear, QuantizedLinear

    if isinstance(w, GGMLLinear):
        return f"{'+'.join(w.stored_types)} as stored -> ggml dot products (activations as {_dot_types(w)})"
    if isinstance(w, BlockLinear):
        stored = "+".join(w.stored_types) if w.stored_types else "from float"
        copy = f", dense {w.dense.dtype} copy above {w.max_rows} rows" if w.dense is not None else ""
        from forklm.kernels.block_gemm import HALF_KINDS

        acts = "float32 activations" if all(p.kind in HALF_KINDS for p in w.parts) else "Q8 activations"
        return f"{stored} -> block kernel ({w.kind} layout, {acts}{copy})"
    if isinstance(w, QuantizedLinear):
        copy = f", dense {w.dense.dtype} copy above {w.max_rows} rows" if w.dense is not None else ""
        return f"{w.kind} -> PyTorch's {w.kind} kernel ({w.dtype} activations{copy})"
    return f"dense {w.dtype}"


def _dot_types(w: Any) -> str:
    from forklm.kernels import ggml_gemm

    return "+".join(dict.fromkeys(ggml_gemm.vec_dot_type(p.type_name) for p in w.parts))


def _bytes(w: Any) -> int:
    from forklm.models.quant import QuantizedLinear

    ts = w.tensors() if isinstance(w, QuantizedLinear) else [w]
    return sum(t.numel() * t.element_size() for t in ts)


def _products(pairs, unit: str = "layers") -> dict[str, str]:
    """(kind, weight) pairs grouped by kind and placement: how many, and their bytes."""
    groups: Counter = Counter()
    sizes: Counter = Counter()
    for name, w in pairs:
        key = f"{name}: {_placement(w)}"
        groups[key] += 1
        sizes[key] += _bytes(w)
    return {k: f"{n} {'experts' if k.startswith('expert') else unit}, {sizes[k] / 2**20:.1f} MiB"
            for k, n in groups.items()}


def model_report(llm: Any) -> dict[str, Any]:
    from forklm.models.deepseek import DeepseekModel

    m = llm.model
    if isinstance(m, DeepseekModel):
        c = m.config
        return {
            "source": str(llm.source), "architecture": c.architecture, "dtype": str(llm.dtype).replace("torch.", ""),
            "quantize": llm.quantize, "backend": m.backend.describe(),
            "fall-backs from the fast path": "; ".join(m.backend.fallbacks) or "none",
            "attention": f"multi-head latent, absorbed: {c.num_heads} query heads over one cached latent of "
                         f"{c.kv_lora_rank} + {c.qk_rope_head_dim} per token and layer "
                         f"({c.kv_bytes_per_token(m.dtype.itemsize)} bytes a token in {m.dtype})",
            "layers": _products(m.named_matrices()),
            "lm_head": f"{_placement(m.lm_head)}, {_bytes(m.lm_head) / 2**20:.1f} MiB",
            "embedding": "dense table" if m.embed is not None else "rows dequantized from the stored table on lookup",
            "decode stack": "off (DeepSeek layers run one by one)",
            "weights resident": f"{m.num_weight_bytes() / 2**20:.1f} MiB",
        }
    from forklm.models.gpt2 import GPT2Model

    gpt2 = isinstance(m, GPT2Model)
    names = ("qkv", "o", "fc", "proj") if gpt2 else ("qkv", "o", "gate_up", "down")
    layers = _products((name, layer[name]) for layer in m.layers for name in names)
    if gpt2:
        c = m.config
        el = c.el_cache_config()
        return {
            "source": str(llm.source), "architecture": c.architecture, "dtype": str(llm.dtype).replace("torch.", ""),
            "quantize": llm.quantize, "backend": m.backend.describe(),
            "fall-backs from the fast path": "; ".join(m.backend.fallbacks) or "none",
            "layers": layers,
            "lm_head": f"{_placement(m.lm_head)} (tied to the token table)",
            "attention": f"{c.num_heads} heads of {c.head_dim}, {c.num_kv_heads} KV heads, learned positions: K/V "
                         f"{c.kv_bytes_per_token(m.dtype.itemsize)} bytes a token, or EL-attention "
                         f"(attention='el') {el.kv_bytes_per_token(m.dtype.itemsize)}",
            "decode stack": "off (GPT-2 layers run one by one)",
            "weights resident": f"{m.num_weight_bytes() / 2**20:.1f} MiB",
        }
    stack = m.prepare_decode_stack()
    report = {
        "source": str(llm.source), "architecture": llm.config.architecture, "dtype": str(llm.dtype).replace("torch.", ""),
        "quantize": llm.quantize,
        "backend": m.backend.describe(),
        "fall-backs from the fast path": "; ".join(m.backend.fallbacks) or "none",
        "layers": layers,
        "lm_head": f"{_placement(m.lm_head)}, {_bytes(m.lm_head) / 2**20:.1f} MiB",
        "embedding": "dense table" if m.embed is not None else "rows dequantized from the stored table on lookup",
        "decode stack": "on" if stack is not None else "off (" + _why_no_stack(m) + ")",
        "weights resident": f"{m.num_weight_bytes() / 2**20:.1f} MiB",
    }
    return report


def _why_no_stack(m: Any) -> str:
    from forklm.kernels import decode_stack

    return decode_stack.build_error() or decode_stack.unsupported_reason(m) or "not built"


def _openmp() -> str:
    from forklm.kernels.block_gemm import openmp_runtime

    return openmp_runtime() or "none loaded"


def _cache_root():
    from forklm.kernels.native import cache_root

    return cache_root()


def report(llm: Any | None = None) -> dict[str, Any]:
    flags = cpu_flags()
    doc = {
        "cpu": cpu_model(),
        "cpu features forklm's rules see": " ".join(f for f in FLAGS_SHOWN if f in flags) or "none of " + ", ".join(FLAGS_SHOWN),
        "FORKLM_CPU_ISA": os.environ.get("FORKLM_CPU_ISA", "native"),
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads, OpenMP runtime {_openmp()}",
        "kernel builds": str(_cache_root()),
        "kernels": kernels_report(),
    }
    if llm is not None:
        doc["model"] = model_report(llm)
    return doc


def format_report(doc: dict[str, Any], indent: int = 0) -> str:
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(format_report(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {value}")
    return "\n".join(lines)
