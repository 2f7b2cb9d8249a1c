"""What machine a benchmark ran on: CPU model and the features that decide kernel speed."""

from __future__ import annotations

import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """CPU model, its vector features (AVX2, AVX-512, AVX512-BF16, AMX), cores, torch version."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "cpu": cpu_model(),
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }
