"""The per-step time floor of docs/design.md, with both ceilings measured on this machine.

    floor = max(bytes moved / memory bandwidth, FLOPs / peak matmul rate)     [seconds]

Bytes per decode step: the weights once, plus the KV cache the attention reads
(L layers, g KV heads, head size k, e bytes per element, context m_c, m_d own tokens, b samples):

    KV read, naive      = 2·L·g·k·e · b·(m_c + m_d)
    KV read, bifurcated = 2·L·g·k·e · (m_c + b·m_d)

FLOPs per decode step: 2·(matmul parameters)·b + 4·L·h·k·b·(m_c + m_d) (q·Kᵀ and p·V; the same
for both attention paths). The ceilings are a large copy (bytes read + written per second) and
the fastest of a few matrix products in the benchmark's dtype.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from forklm.config import ModelConfig


@dataclass
class Ceilings:
    """Measured hardware ceilings for one device and dtype."""

    bandwidth_bytes_per_s: float  # copy: (bytes read + bytes written) / s
    matmul_flops_per_s: float  # the fastest product measured, 2·M·N·K / s
    matmul_shapes: dict[str, float] = field(default_factory=dict)  # "MxKxN" -> GFLOP/s
    copy_bytes: int = 0  # size of the copied tensor

    def as_json(self) -> dict:
        d = asdict(self)
        d["bandwidth_GBps"] = self.bandwidth_bytes_per_s / 1e9
        d["matmul_GFLOPs"] = self.matmul_flops_per_s / 1e9
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 5) -> tuple[float, int]:
    """(bytes/s, tensor bytes) of copying one large tensor into another: 2·nbytes moved per copy.

    Default size 512 MiB on CPU, 1 GiB on CUDA, far beyond any cache.
    """
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**29
    numel = nbytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # both touched, so no page faults inside the timed copies
    t = _median_time(lambda: dst.copy_(src), device, reps)
    del src, dst
    return 2 * numel * 4 / t, numel * 4


def measure_matmul_rate(
    dtype: torch.dtype, device: torch.device, shapes: list[tuple[int, int, int]], reps: int = 3
) -> dict[str, float]:
    """FLOP/s of `[M, K] @ [K, N]` in `dtype` for each (M, K, N), keyed "MxKxN"."""
    rates = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for M, K, N in shapes:
        a = torch.randn(M, K, generator=gen, device=device).to(dtype)
        b = torch.randn(K, N, generator=gen, device=device).to(dtype)
        t = _median_time(lambda: a @ b, device, reps)
        rates[f"{M}x{K}x{N}"] = 2 * M * K * N / t
    return rates


def step_matmul_shapes(config: ModelConfig, max_n: int, device: torch.device) -> list[tuple[int, int, int]]:
    """A large square product plus the decode step's biggest products at the largest batch."""
    big = 4096 if device.type == "cuda" else 2048
    H, I = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    b = max(1, max_n)
    return [(big, big, big), (b, H, qkv), (b, H, 2 * I), (b, H, config.vocab_size)]


def measure_ceilings(
    dtype: torch.dtype, device: torch.device, shapes: list[tuple[int, int, int]], copy_bytes: int | None = None
) -> Ceilings:
    """Bandwidth and peak matmul rate ("peak" = the fastest of `shapes`)."""
    bw, nbytes = measure_bandwidth(device, copy_bytes)
    rates = measure_matmul_rate(dtype, device, shapes)
    return Ceilings(
        bandwidth_bytes_per_s=bw,
        matmul_flops_per_s=max(rates.values()),
        matmul_shapes={k: v / 1e9 for k, v in rates.items()},
        copy_bytes=nbytes,
    )


# ---------------------------------------------------------------------- the model's side
def matmul_parameters(config: ModelConfig) -> int:
    """Parameters that take part in a matrix product per token: all but the embedding lookup and norms
    (a mixture of experts: the experts one token is routed to, DeepseekConfig.num_parameters(active=True))."""
    embed_lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    norms = (2 * config.num_layers + 1) * config.hidden_size
    moe = hasattr(config, "n_routed_experts")
    return (config.num_parameters(active=True) if moe else config.num_parameters()) - embed_lookup - norms


def kv_read_bytes(config: ModelConfig, element_bytes: int, b: int, m_c: int, m_d: float, bifurcated: bool) -> float:
    """KV bytes one decode step reads over all layers (docs/design.md)."""
    per_token = config.kv_bytes_per_token(element_bytes)  # 2·L·g·k·e
    return per_token * ((m_c + b * m_d) if bifurcated else b * (m_c + m_d))


def step_flops(config: ModelConfig, b: int, m_c: int, m_d: float) -> float:
    """FLOPs of one decode step of b samples: 2·params·b + 4·L·h·k·b·(m_c + m_d)."""
    attn = 4 * config.num_layers * config.num_heads * config.head_dim * b * (m_c + m_d)
    return 2 * matmul_parameters(config) * b + attn


@dataclass
class StepFloor:
    """Floor of one decode step, seconds; and what it is made of."""

    floor_s: float  # bifurcated KV bytes: what the best engine must do
    floor_naive_s: float  # every sample re-reads the context KV
    bytes_bifurcated: float
    bytes_naive: float
    flops: float


def step_floor(
    config: ModelConfig,
    weight_bytes: int,
    element_bytes: int,
    b: int,
    m_c: int,
    new_tokens: int,
    ceilings: Ceilings,
) -> StepFloor:
    """Floor of the average decode step of `new_tokens` (m_d = new_tokens / 2 own tokens)."""
    m_d = new_tokens / 2
    flops = step_flops(config, b, m_c, m_d)
    compute_s = flops / ceilings.matmul_flops_per_s
    by_bif = weight_bytes + kv_read_bytes(config, element_bytes, b, m_c, m_d, bifurcated=True)
    by_naive = weight_bytes + kv_read_bytes(config, element_bytes, b, m_c, m_d, bifurcated=False)
    bw = ceilings.bandwidth_bytes_per_s
    return StepFloor(
        floor_s=max(by_bif / bw, compute_s),
        floor_naive_s=max(by_naive / bw, compute_s),
        bytes_bifurcated=by_bif,
        bytes_naive=by_naive,
        flops=flops,
    )
