"""What machine a benchmark ran on: CPU model and the features that decide kernel speed."""

from __future__ import annotations

import os
import platform

import torch

from forklm.device import cpu_flags, cpu_model


def machine_info() -> dict:
    """CPU model, its vector features as forklm's rules see them (AVX2, AVX-512, AVX512-BF16, AMX;
    FORKLM_CPU_ISA=avx2 hides those past AVX2), the ISA PyTorch's kernels run, cores, torch version."""
    flags = cpu_flags()
    return {
        "cpu": cpu_model(),
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
        "forklm_cpu_isa": os.environ.get("FORKLM_CPU_ISA", "native"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }
