"""The plain reference: materialize each sample's full K/V, softmax in float32, weighted sum.

Slow and obvious on purpose; every fast attention path is tested against it.
"""

from __future__ import annotations

import math

import torch


def reference_decode_attention(
    q: torch.Tensor,  # [b, h, D]: one new query per sample
    ctx_k: torch.Tensor,  # [g, m_c, D]: the shared prompt keys
    ctx_v: torch.Tensor,  # [g, m_c, D]
    own_k: torch.Tensor,  # [b, g, m_d, D]: each sample's own keys (its new token included)
    own_v: torch.Tensor,  # [b, g, m_d, D]
) -> torch.Tensor:  # [b, h, D] float32
    b, h, D = q.shape
    g = ctx_k.shape[0]
    out = torch.empty(b, h, D, dtype=torch.float32)
    for i in range(b):
        keys = torch.cat([ctx_k, own_k[i]], dim=1).float()  # [g, m_c + m_d, D]
        vals = torch.cat([ctx_v, own_v[i]], dim=1).float()
        for j in range(h):
            kv_head = j // (h // g)
            scores = keys[kv_head] @ q[i, j].float() / math.sqrt(D)  # [m_c + m_d]
            weights = torch.softmax(scores, dim=0)
            out[i, j] = weights @ vals[kv_head]
    return out
