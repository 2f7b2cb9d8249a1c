"""The KV tensors behind a `BlockPool`: one K and one V tensor per layer, addressed by slot.

Block `b` of the pool owns the token slots `[b * block_size, (b + 1) * block_size)`. Per layer
K and V are `[g, num_blocks * block_size, D]`: a KV head's keys for a run of consecutive blocks
are one contiguous view (no copy), which is what lets a shared prefix be read in place.
Token `t` of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forklm.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    e = torch.empty((), dtype=dtype).element_size()
    return config.kv_bytes_per_token(e) * block_size


def slots_of(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of tokens [start, end) of a sequence with this block table."""
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]


def slot_runs(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[tuple[int, int]]:
    """Tokens [start, end) as maximal runs of consecutive slots: [(first_slot, length), ...]."""
    runs: list[tuple[int, int]] = []
    t = start
    while t < end:
        b = block_table[t // block_size]
        off = t % block_size
        take = min(block_size - off, end - t)
        s = b * block_size + off
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + take)
        else:
            runs.append((s, take))
        t += take
    return runs


def _zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, lazily committed on CPU: numpy's zeros is calloc, whose large blocks are fresh
    zero pages the OS maps on first write (torch.zeros writes every page at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    # numpy asks the kernel for transparent huge pages on large arrays (madvise): the first write to
    # each layer's K and V then commits 2 MB at once (240 MB for a 16-token prompt on a 30-layer
    # model); 4 KB pages keep the resident pool to the slots written
    from numpy._core import multiarray

    toggle = getattr(multiarray, "_set_madvise_hugepage", None)
    was = toggle(False) if toggle is not None else None
    try:
        zeros = np.zeros(nbytes, dtype=np.uint8)
    finally:
        if toggle is not None:
            toggle(was)
    return torch.from_numpy(zeros).view(dtype).view(shape)


class PagedKVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        g, D = config.num_kv_heads, config.head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.dtype = dtype
        self.device = device
        # Zeros, never garbage: a masked read of ragged tails (attention/paged.py) reads slots past
        # a row's length, and a NaN or inf there would spread through the masked product (masked
        # slots hold zeros or K/V the model wrote; only a model that writes non-finite K/V, already
        # broken, could spread it to a row of its masked group). On CPU the zeros come from calloc,
        # so pages the engine never touches are never committed by the OS.
        self.k = [_zeros(g, self.num_slots, D, dtype=dtype, device=device) for _ in range(config.num_layers)]
        # latent attention (config.kv_shares_values): the values are the keys' first dims, read from
        # the same tensors (an attention over them slices its output), so no V is stored
        self.shares_values = bool(getattr(config, "kv_shares_values", False))
        self.v = self.k if self.shares_values else [
            _zeros(g, self.num_slots, D, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new keys/values: slots [T] int64, k/v [T, g, D] (rounded to the cache's dtype)."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        if not self.shares_values:
            self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies the KV of slots `src` to slots `dst` in every layer (copy-on-write of a partial block)."""
        if not src:
            return
        s = torch.tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        for t in self._tensors():
            t.index_copy_(1, d, t.index_select(1, s))

    def commit(self) -> None:
        """Touches every page of the pool now (a long-running server's memory is then what it
        will stay, and a machine short of memory fails at start, not mid-request)."""
        for t in self._tensors():
            t.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return self.k if self.shares_values else self.k + self.v
