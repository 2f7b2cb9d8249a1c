"""What machine a benchmark ran on: CPU model and the features that decide kernel speed."""

from __future__ import annotations

import os
import platform

import torch

from forklm.device import cpu_flags, cpu_model


def cpuid_family_model() -> str:
    """'family F model M' from /proc/cpuinfo: a VM's model name can hide the core generation
    ("AMD EPYC" is Zen 3, 4 or 5)."""
    fam = mod = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key == "cpu family" and fam == "?":
                    fam = line.split(":", 1)[1].strip()
                elif key == "model" and mod == "?":
                    mod = line.split(":", 1)[1].strip()
                if fam != "?" and mod != "?":
                    break
    except OSError:
        pass
    return f"family {fam} model {mod}"


def machine_info() -> dict:
    """CPU model, its vector features as forklm's rules see them (AVX2, AVX-512, AVX512-BF16, AMX;
    FORKLM_CPU_ISA=avx2 hides those past AVX2), the ISA PyTorch's kernels run, cores, torch version."""
    flags = cpu_flags()
    return {
        "cpu": cpu_model(),
        "cpuid": cpuid_family_model(),
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
