"""Decode attention over the paged KV cache in one C++ call per layer, for float32 models on x86
CPUs with AVX2 (csrc/paged_attention.cpp, built like the block kernel: once per machine).

Why: on a CPU the Python path of `attention/paged.py` spends most of a small decode step dispatching
PyTorch operators (rotary, the cache write, a flash call per KV segment, log-sum-exp merges: ~40 a
layer), not computing. Here the step's work is *items*, as for the Triton kernel
(`kernels/segment_attention.py`): a run of KV blocks and the decode rows that read it (a shared
prompt lists all the samples sharing it, read once for all of them; each row's own tail is an item
of its own). `CpuAttentionPlan` holds the items as int32 tables, built once per step; every layer
makes one call that (optionally) rotates the new q/k, writes the new K/V, attends and merges.

    plan = plan_items(items, num_rows, block_size)
    o = paged_attention(qkv, k_cache, v_cache, plan, num_heads, rope=(cos, sin, write_slots))

`paged_attention_reference` is the slow, obvious version the tests hold it to. The engine uses it
(`EngineConfig.decode_kernel="auto"`) for float32 models on CPUs with AVX2; FORKLM_CPU_ATTENTION=0 in
the environment turns it off (PyTorch's attention path then, as before).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from forklm.kernels.block_gemm import LOADED_BUILDS, cpu_extension_error, load_block_kernel_build
from forklm.kernels.segment_attention import SegmentItem

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CHUNK_TOKENS = 512  # keys per unit of thread work (an item's keys are split into chunks this long)


@lru_cache(maxsize=1)
def _extension():
    # the block kernel's build rule: on CPUs with AVX512-VNNI the build with AVX-512, whose many-row
    # tiles run 16 lanes a vector with the same chains as the AVX2 build's (the same bits), as the
    # decode stack, which compiles this source into the block kernel's build, does
    return load_block_kernel_build("forklm_paged_attention", _SOURCE)


def loaded_build() -> str | None:
    """"AVX512-VNNI" (the many-row tiles on 512-bit vectors) or "AVX2" once loaded, else None."""
    return LOADED_BUILDS.get("forklm_paged_attention")


@lru_cache(maxsize=1)
def build_error() -> str | None:
    """None when the kernel is built and loaded (building it on first call), else why not."""
    if os.environ.get("FORKLM_CPU_ATTENTION", "1") == "0":
        return "disabled by FORKLM_CPU_ATTENTION=0"
    return cpu_extension_error(_extension, "C++ attention")


def available() -> bool:
    return build_error() is None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model of this dtype and head size runs on the kernel here (a fixed rule)."""
    return dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and available()


@dataclass
class CpuAttentionPlan:
    """Items as int32 tables (CSR): item i is read by rows[rows_start[i]:rows_start[i+1]] and holds
    `tokens[i]` tokens in blocks[blocks_start[i]:blocks_start[i+1]]."""

    num_rows: int
    block_size: int
    rows_start: torch.Tensor  # [I + 1]
    rows: torch.Tensor  # [Σ rows]
    blocks_start: torch.Tensor  # [I + 1]
    blocks: torch.Tensor  # [Σ blocks]
    tokens: torch.Tensor  # [I]


def plan_items(items: Sequence[SegmentItem], num_rows: int, block_size: int) -> CpuAttentionPlan:
    """Tables for one step; every row's items must cover its keys exactly once between them."""
    rows_start, rows, blocks_start, blocks, tokens = [0], [], [0], [], []
    for it in items:
        rows.extend(it.rows)
        rows_start.append(len(rows))
        blocks.extend(it.blocks)
        blocks_start.append(len(blocks))
        tokens.append(it.num_tokens)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    return CpuAttentionPlan(num_rows, block_size, i32(rows_start), i32(rows), i32(blocks_start), i32(blocks), i32(tokens))


def paged_attention(
    q: torch.Tensor,  # [R, h, D] rotated queries; or [T, (h + 2g)·D] q/k/v rows with `rope`
    k_cache: torch.Tensor,  # [g, slots, D] float32
    v_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    num_heads: int,
    scale: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # cos, sin_signed [T, D], write slots [T]
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:  # [R, h·D] float32
    """Every plan row's attention over the union of its items' keys. With `rope`, first the rotary
    embedding of q and k (as the model's `apply_rope`, bit for bit) and the new K/V written to
    their slots: the whole attention of a decode layer in one call."""
    D = k_cache.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cos = sin = slots = None
    if rope is not None:
        cos, sin, slots = rope
    return _extension().paged_attention(
        q, cos, sin, k_cache, v_cache, slots, num_heads, plan.num_rows, plan.rows_start, plan.rows,
        plan.blocks_start, plan.blocks, plan.tokens, plan.block_size, scale, chunk_tokens,
    )


def state_budget_bytes() -> int:
    """The most bytes of online-softmax chunk states one call keeps (default 256 MiB); past it the
    rows run in groups, each reading its items' keys again, with the same output bits."""
    return int(_extension().state_budget_bytes())


def set_state_budget_bytes(nbytes: int) -> None:
    _extension().set_state_budget_bytes(int(nbytes))


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              items: Sequence[SegmentItem], block_size: int, scale: float | None = None) -> torch.Tensor:
    """The slow, obvious version: each row's keys gathered from its items, softmax in float64.
    q [R, h, D] -> [R, h·D] float32."""
    R, h, D = q.shape
    g = k_cache.shape[0]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    slots: list[list[int]] = [[] for _ in range(R)]
    for it in items:
        s = [it.blocks[t // block_size] * block_size + t % block_size for t in range(it.num_tokens)]
        for r in it.rows:
            slots[r].extend(s)
    out = torch.empty(R, h, D, dtype=torch.float64)
    for r in range(R):
        idx = torch.tensor(slots[r], dtype=torch.long)
        k = k_cache[:, idx].double().repeat_interleave(h // g, dim=0)  # [h, S, D]
        v = v_cache[:, idx].double().repeat_interleave(h // g, dim=0)
        w = torch.softmax((q[r].double().unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)  # [h, 1, S]
        out[r] = (w @ v).squeeze(1)
    return out.reshape(R, h * D).float()
