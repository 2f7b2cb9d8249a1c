"""Counter-based randomness: sample i's draw at step t depends only on (seed, i, t).

So a sample's tokens do not depend on how many siblings it has, on the attention path, or on
what else shares the batch. One uniform per (seed, sample, step) drives an inverse-CDF draw.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def counter_uniform(seed: int, sample_index: int, step: int) -> float:
    """A uniform in [0, 1) from the triple; 53 random bits."""
    x = splitmix64(seed & _MASK)
    x = splitmix64(x ^ (sample_index & _MASK))
    x = splitmix64(x ^ (step & _MASK))
    return (x >> 11) * (1.0 / (1 << 53))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`splitmix64` of every element (uint64 arithmetic wraps exactly like the 64-bit mask)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seeds: Sequence[int], sample_indices: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """`counter_uniform` of each (seed, sample, step) triple, computed for the batch at once:
    float64 [len(seeds)], bit for bit the scalar function's values."""
    x = _splitmix64_array(np.array([s & _MASK for s in seeds], dtype=np.uint64))
    x = _splitmix64_array(x ^ np.array(sample_indices, dtype=np.uint64))
    x = _splitmix64_array(x ^ np.array(steps, dtype=np.uint64))
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)))


def fresh_seed() -> int:
    """A random seed for requests that give none (reported back so a run can be repeated)."""
    return int.from_bytes(os.urandom(8), "little") >> 1
