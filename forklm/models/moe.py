"""Mixture-of-experts feed-forward (DeepSeek-V2/V3): a router, routed SwiGLU experts run with tokens
batched by expert, and shared experts every token passes through.

Routing follows transformers' `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter` step for step (float32
logits; softmax with greedy or group-limited top-k; sigmoid plus the correction bias with top-2-sum
group scores, the bias used for the choice only); the experts' sum follows `DeepseekV3Experts`
(each expert's rows gathered, one product, scaled by the routing weight, scatter-added).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from forklm.backend import Backend
from forklm.models.quant import linear as quantized_linear


def product_for(backend: Backend) -> Callable:
    """The dense product x [T, in] @ W for weights in the backend's layout (as LlamaModel runs them)."""
    if backend.quantized_kernels:
        return quantized_linear  # QuantizedLinear or a dense [out, in] weight
    if backend.weight_layout == "in_out":
        return torch.matmul  # W [in, out]
    return F.linear  # W [out, in]


def dense_rows_for(backend: Backend) -> Callable:
    """Batched float32 products x [T, B, K] times w [B, N, K] transposed -> [T, B, N] in which a row's
    result depends on that row alone (the block kernel's `dense_rows`), where it runs; else PyTorch's
    einsum (whose kernels change with the number of rows: the fall-back is recorded)."""
    if backend.device.type == "cpu":
        from forklm.kernels import block_gemm

        if block_gemm.available():
            return block_gemm.dense_rows
        backend.fallbacks.append("routers and W_UK / W_UV run PyTorch's float32 products, whose rounding changes with "
                                 f"the number of rows ({block_gemm.build_error() or 'no AVX2'}): a seeded sample may "
                                 "depend on n")
    return _einsum_rows


def _einsum_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tbk,bnk->tbn", x, w)


class SwiGLU:
    """down(silu(gate(x)) * up(x)) with gate and up fused in one product: a dense MLP, one routed
    expert or the shared experts."""

    def __init__(self, gate_up, down, product: Callable) -> None:
        self.gate_up, self.down, self.product = gate_up, down, product  # [H, 2I], [I, H] ("in_out")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        gate, up = self.product(x, self.gate_up).chunk(2, dim=-1)
        return self.product(F.silu(gate) * up, self.down)


class Router:
    """Top-k expert choice per token: (weights [T, k] float32, experts [T, k] int64)."""

    def __init__(self, weight: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int, scoring: str,
                 topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
                 rows: Callable) -> None:
        self.weight = weight.float().contiguous()  # [E, H], kept float32 as transformers keeps it
        self.rows = rows  # dense_rows_for(backend)
        self.bias = None if correction_bias is None else correction_bias.float()  # [E] (sigmoid scoring)
        self.top_k, self.scoring, self.topk_method = top_k, scoring, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.rows(x.float()[:, None], self.weight[None])[:, 0]  # [T, E]
        if self.scoring == "sigmoid":
            weights, experts = self._sigmoid_route(logits.sigmoid())
        else:
            weights, experts = self._softmax_route(logits.softmax(dim=-1, dtype=torch.float32))
        return weights * self.scaling, experts

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, G] group scores -> [T, E] bool: the experts of each token's `topk_group` best groups."""
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        per_group = self.num_experts // self.n_group
        return group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts).bool()

    def _softmax_route(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2: greedy, or group-limited (groups ranked by their best expert, the rest zeroed)."""
        if self.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, self.n_group, self.num_experts // self.n_group).max(dim=-1).values
            scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
        weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts

    def _sigmoid_route(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 ("noaux_tc"): choice by score + bias within the best groups (each ranked by the
        sum of its top-2), weights the chosen experts' unbiased scores."""
        choice = scores + self.bias
        group_scores = choice.view(-1, self.n_group, self.num_experts // self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, experts


class MoE:
    """Routed experts (tokens batched by expert: one product per expert for all the rows routed to
    it, however many samples they come from) plus the shared experts."""

    def __init__(self, router: Router, experts: list[SwiGLU], shared: SwiGLU) -> None:
        self.router, self.experts, self.shared = router, experts, shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        weights, experts = self.router(x)
        return self.routed(x, weights, experts) + self.shared(x)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]): rows gathered per expert, one product, scatter-added."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T·k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, rows ascending within one
        rows = order // k  # [T·k] token row of each assignment
        row_weights = weights.reshape(-1)[order]  # [T·k]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = rows[start : start + n]
            y = self.experts[e](x[idx]) * row_weights[start : start + n, None]  # [n, H]
            out.index_add_(0, idx, y.to(out.dtype))
            start += n
        return out
