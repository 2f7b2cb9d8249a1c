"""Top-k / top-p draws on the CPU in one C++ call (csrc/sampler.cpp, built like the block kernel:
once per machine).

Why: the PyTorch path of `sampling/sampler.py` (a 64-wide probe, then a radix select over the whole
vocabulary, then a two-level inverse CDF) runs ~25 full-row operators per draw: 1.4 ms of a 9.7 ms
decode step at one sample, 34 ms of a 141 ms step at 64 (49k vocabulary, flat rows; this takes 0.35
and 5.5 ms: bench/results/cpu_sampler_step_cpu_avx512.json). Here each row takes a few passes over
its logits (sampler.cpp says how), rows split across threads.

    tokens = sample_logits(logits, temperature, top_k, top_p, u)   # logits float32 [b, V], u float64 [b]
    logprobs = token_logprobs(logits, tokens)                      # the model's log-softmax of each

The rule is `sampler.sample_weights_reference`'s (the slow, obvious version by sorting, which the
tests hold this to token for token, given `sample_weights`). `sampler.sample_tokens` and
`sampler.model_logprobs` use it for CPU tensors when it is built here; FORKLM_CPU_SAMPLER=0 in the
environment turns it off (the PyTorch path then).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

from forklm.kernels.block_gemm import cpu_extension_error, load_cpu_extension

_SOURCE = Path(__file__).parent / "csrc" / "sampler.cpp"


@lru_cache(maxsize=1)
def _extension():
    return load_cpu_extension("forklm_sampler", _SOURCE)


@lru_cache(maxsize=1)
def build_error() -> str | None:
    """None when the kernel is built and loaded (building it on first call), else why not."""
    if os.environ.get("FORKLM_CPU_SAMPLER", "1") == "0":
        return "disabled by FORKLM_CPU_SAMPLER=0"
    return cpu_extension_error(_extension, "C++ sampler")


def available() -> bool:
    return build_error() is None


def sample_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """logits float32 [b, V], u float64 [b] in [0, 1) -> token ids int64 [b] (temperature > 0). A row
    holding a NaN or +inf, or only -inf (a model gone wrong) gets token 0 instead of an exception."""
    return _extension().sample_logits(logits, float(temperature), int(top_k), float(top_p), u)


def sample_weights(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The weights `sample_logits` draws from, float32 [b, V]: exp(l / T - max l / T) (a broken row: NaN)."""
    return _extension().sample_weights(logits, float(temperature))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[r, tokens[r]], float32 [b] (a broken row: NaN)."""
    return _extension().token_logprobs(logits, tokens)
