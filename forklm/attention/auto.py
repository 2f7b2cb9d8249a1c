"""`attention="auto"`: per decode step, bifurcated or standard, by a rule measured here.

Data: `bench/results/attention_sweep_cpu.json` (one layer of SmolLM2-135M's shape, h=9, g=3,
D=64, 32 own tokens, float32 and bfloat16, 2-core AVX-512 Xeon), made by
`python -m bench.attention_sweep`. Summary (standard time / bifurcated time):

    b = 1                       0.93-1.03  (the same work; bifurcation only adds a copy)
    b = 2-4, m_c <= 256         0.87-1.10  (the extra query transpose and merge cost as much as they save)
    b = 8-64, any m_c >= 16     1.03-3.9
    b >= 2, m_c >= 1024         1.03-3.9   (grows with b and m_c: the prompt is read once, not b times)

Rule: bifurcate when there are at least 2 samples and either b >= 8 or b * m_c >= 1024.
Where it chooses wrongly in the sweep the loss is at most 3% of the attention time (b=4,
m_c=256, float32). The same rule is used on CUDA until issue #6 re-measures it there.
"""

from __future__ import annotations

MIN_SAMPLES = 2
ALWAYS_FROM_SAMPLES = 8
MIN_SHARED_READS = 1024  # b * m_c


def choose_decode_path(device_type: str, num_samples: int, context_len: int, own_len: int) -> str:
    """"bifurcated" or "standard" for one step of `num_samples` samples sharing `context_len` tokens."""
    if num_samples < MIN_SAMPLES or context_len == 0:
        return "standard"
    if num_samples >= ALWAYS_FROM_SAMPLES or num_samples * context_len >= MIN_SHARED_READS:
        return "bifurcated"
    return "standard"
