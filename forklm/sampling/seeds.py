"""Counter-based randomness: sample i's draw at step t depends only on (seed, i, t).

So a sample's tokens do not depend on how many siblings it has, on the attention path, or on
what else shares the batch. One uniform per (seed, sample, step) drives an inverse-CDF draw.
"""

from __future__ import annotations

import os

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


def fresh_seed() -> int:
    """A random seed for requests that give none (reported back so a run can be repeated)."""
    return int.from_bytes(os.urandom(8), "little") >> 1
