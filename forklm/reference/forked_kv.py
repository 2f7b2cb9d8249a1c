"""KV storage for one request whose `n` samples fork from one prompt.

The prompt's K/V is stored once per layer (`[1, g, m_c, D]`, the paper's `[g, m_c, k]`), never
once per sample. Each sample owns only the K/V of the tokens it decoded itself
(`[b, g, max_new, D]`, preallocated). Samples decode in lockstep, so all live samples have the
same number `own_len` of own tokens; a sample that finishes leaves the batch via `keep_rows`.
"""

from __future__ import annotations

import torch


class ForkedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        context_len: int,
        max_new_tokens: int,
        num_samples: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        g, d = num_kv_heads, head_dim
        self.context_len = context_len
        self.max_new_tokens = max_new_tokens
        self.ctx_k = [torch.empty(1, g, context_len, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ctx_v = [torch.empty(1, g, context_len, d, dtype=dtype, device=device) for _ in range(num_layers)]
        # Own KV is allocated at fork time (after prefill), so prefill memory does not depend on n.
        self._own_shape = (num_samples, g, max_new_tokens, d)
        self._dtype, self._device = dtype, device
        self.own_k: list[torch.Tensor] = []
        self.own_v: list[torch.Tensor] = []
        self.num_layers = num_layers
        self.own_len = 0  # tokens each live sample has decoded and stored

    def fork(self) -> None:
        """Allocates each sample's own KV storage; call once after the prompt's prefill."""
        self.own_k = [torch.empty(self._own_shape, dtype=self._dtype, device=self._device) for _ in range(self.num_layers)]
        self.own_v = [torch.empty(self._own_shape, dtype=self._dtype, device=self._device) for _ in range(self.num_layers)]

    @property
    def num_live(self) -> int:
        return self.own_k[0].shape[0] if self.own_k else 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drops the samples not in `rows` (their own KV is freed); the prompt KV is untouched."""
        self.own_k = [k.index_select(0, rows) for k in self.own_k]
        self.own_v = [v.index_select(0, rows) for v in self.own_v]

    def nbytes(self) -> int:
        tensors = self.ctx_k + self.ctx_v + self.own_k + self.own_v
        return sum(t.numel() * t.element_size() for t in tensors)
