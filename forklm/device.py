"""Device and dtype choice: CUDA when present; bfloat16 only where the hardware computes it natively."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from forklm.errors import InvalidArgumentError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


# Instruction sets past AVX2 that forklm's rules look at (and their relatives): FORKLM_CPU_ISA=avx2
# hides them, so an AVX-512 machine takes every choice an AVX2-only CPU would (set beside
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 for PyTorch's own
# kernels, and llama.cpp's AVX2 build: scripts/build_llama_cpp.sh with LLAMA_CPP_ISA=avx2).
_ABOVE_AVX2_PREFIXES = ("avx512", "amx", "avx_vnni", "avx10")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), less every
    instruction set past AVX2 when FORKLM_CPU_ISA=avx2."""
    isa = os.environ.get("FORKLM_CPU_ISA", "native")
    if isa not in ("native", "avx2"):
        raise InvalidArgumentError(f"FORKLM_CPU_ISA must be 'native' or 'avx2', got {isa!r}")
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    flags = frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
    if isa == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2_PREFIXES))
    return flags


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what the platform module says)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16).

    Without it PyTorch emulates bfloat16 matrix products, ~5x slower than float32 (measured on
    an AVX-512 Xeon without those flags), so float32 is the better default there.
    """
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = _DTYPES[dtype.lower()]
    else:
        raise InvalidArgumentError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidArgumentError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if resolved == torch.float16 and device.type != "cuda":
        raise InvalidArgumentError("dtype float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return resolved


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can still get on the device."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
