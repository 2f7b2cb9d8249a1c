"""GPT-2 (multi-head attention) and GPT-BigCode (the StarCoder family: multi-query attention) as plain
PyTorch: learned absolute positions, LayerNorm with biases, a GELU MLP, biases on every product,
the LM head tied to the token table. Numerics follow transformers' GPT2LMHeadModel /
GPTBigCodeForCausalLM step for step, so float32 logits match theirs.

Two cache layouts (`GPT2Model.forward` reads which from the attention object it is handed):
- K/V (the default): per layer the g KV heads' keys and values, as every engine caches them;
- EL-attention ("el", `el_cache_config`): per layer one hidden state per token, the attention's
  input x = ln_1(h) (hidden_size wide), and no separate values (the pool's V is its K). Each query
  head is expanded through its key weights, q̃_h = W_K,h · q_h (the key bias adds q_h·b_K,h to every
  score of the row and cancels in the softmax), so scores are q̃_h · x_j; the weighted sum of the
  x_j goes through W_V,h after the sum, plus b_V,h (the weights sum to 1). Exact, and it is
  multi-query attention with one hidden_size-wide head over the pool: the engine's planner and
  both decode kernels run it unchanged (`PagedAttention.attend_latent`), a shared prompt's hidden
  states read once for all samples · heads when bifurcated. It needs no rotary positions: a
  rotary key is rotated per position, so W_K cannot be moved to the query side (DeepSeek's MLA is
  that idea for the rotary era: a small learned latent plus a few rotary dims, models/deepseek.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from forklm.backend import Backend
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.models.llama import _WeightReader
from forklm.models.moe import product_for
from forklm.models.quant import QuantizedLinear

ARCHITECTURES = {"gpt2": "gpt2", "gpt_bigcode": "gpt_bigcode"}
_ACTIVATIONS = {
    "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none",
}


@dataclass(frozen=True)
class GPT2Config:
    architecture: str  # "gpt2" | "gpt_bigcode"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # cached heads: g KV heads; 1 (hidden_size wide) for an EL cache
    head_dim: int  # of the cache: the attention head's, or hidden_size for an EL cache
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5
    activation: str = "tanh"  # GELU's approximation: "tanh" (gelu_new, gelu_pytorch_tanh) or "none"
    scale_attn_weights: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    el: bool = False  # the EL-attention cache layout (hidden states; see the module docstring)
    attn_heads_kv: int = 0  # the attention's own KV heads (num_heads for GPT-2, 1 for multi-query)
    attn_head_dim: int = 0
    conv1d: bool = False  # matrices stored [in, out] (transformers' GPT-2 Conv1D), not [out, in] (GGUF, BigCode)

    @property
    def kv_shares_values(self) -> bool:
        return self.el

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        per_layer = self.hidden_size if self.el else 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * element_bytes

    def el_cache_config(self) -> GPT2Config:
        """This model's config for an EL-attention engine: one hidden_size-wide "KV head", V is K."""
        return replace(self, el=True, num_kv_heads=1, head_dim=self.hidden_size)

    def num_parameters(self) -> int:
        H, I, L = self.hidden_size, self.intermediate_size, self.num_layers
        kv = 2 * self.attn_heads_kv * self.attn_head_dim
        per_layer = (H * (H + kv) + H + kv) + (H * H + H) + (2 * H * I + I + H) + 4 * H
        return L * per_layer + (self.vocab_size + self.max_position_embeddings) * H + 2 * H

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> GPT2Config:
        arch = ARCHITECTURES[cfg["model_type"]]
        try:
            H, heads, layers = int(cfg["n_embd"]), int(cfg["n_head"]), int(cfg["n_layer"])
            vocab, positions = int(cfg["vocab_size"]), int(cfg["n_positions"])
        except KeyError as e:
            raise ModelFileError(f"{source}: missing required key {e.args[0]!r}") from None
        act = cfg.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{source}: unsupported activation_function {act!r} "
                                        f"(supported: {', '.join(_ACTIVATIONS)})")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if cfg.get(key):
                raise UnsupportedModelError(f"{source}: {key}=true is not supported")
        if H % heads:
            raise ModelFileError(f"{source}: n_embd ({H}) must be a multiple of n_head ({heads})")
        D = H // heads
        g = 1 if arch == "gpt_bigcode" and cfg.get("multi_query", True) else heads
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=H, intermediate_size=int(cfg.get("n_inner") or 4 * H),
            num_layers=layers, num_heads=heads, num_kv_heads=g, head_dim=D, max_position_embeddings=positions,
            layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), activation=_ACTIVATIONS[act],
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            attn_heads_kv=g, attn_head_dim=D, conv1d=arch == "gpt2",
        )


def _out_in_shape(w, backend: Backend) -> tuple[int, int]:
    """A product's weight shape as [out, in], whatever form the backend holds it in."""
    if isinstance(w, QuantizedLinear) or backend.weight_layout == "out_in":
        return tuple(w.shape)
    return tuple(w.shape)[::-1]


class GPT2Model:
    """Weights plus a forward pass over either cache layout. Every tensor of the checkpoint is used or
    refused by name (GPT-2's stored attention-mask buffers, `attn.bias` / `attn.masked_bias`, aside)."""

    def __init__(self, config: GPT2Config, weights: dict[str, torch.Tensor], backend: Backend) -> None:
        self.config, self.backend = config, backend
        backend.for_model(config.head_dim)
        self.dtype, self.device = backend.dtype, backend.device
        self.num_valid_tokens = config.vocab_size
        self.product = product_for(backend)
        for name in [n for n in weights if n.endswith((".attn.bias", ".attn.masked_bias"))
                     and weights[n].dim() != 1]:
            del weights[name]  # GPT-2's causal-mask buffers, saved by old transformers
        if config.conv1d:  # Conv1D weights are stored [in, out]: as Linear's [out, in]
            for name in [n for n in weights if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]:
                weights[name] = weights[name].t()
        reader = _WeightReader(weights, backend)
        c = config
        self.wte = reader.take("transformer.wte.weight")  # [V, H]
        self.wpe = reader.take("transformer.wpe.weight")  # [P, H]
        if tuple(self.wte.shape) != (c.vocab_size, c.hidden_size):
            raise ModelFileError(f"transformer.wte.weight has shape {tuple(self.wte.shape)}, config says "
                                 f"{(c.vocab_size, c.hidden_size)}")
        self.layers = [self._build_layer(reader, i) for i in range(c.num_layers)]
        self.ln_f = (reader.take("transformer.ln_f.weight"), reader.take("transformer.ln_f.bias"))
        if "lm_head.weight" in weights and not c.tie_word_embeddings:
            self.lm_head = reader.matrix("lm_head.weight")
        else:
            weights.pop("lm_head.weight", None)
            self.lm_head = reader.transposed(self.wte) if backend.weight_layout == "in_out" else self.wte
        self._el: list[dict[str, torch.Tensor]] = []  # EL-attention's weights per layer (`_el_weights`)
        unused = sorted(weights)
        if unused:
            more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
            raise UnsupportedModelError(f"checkpoint has tensors a {c.architecture} model does not use: "
                                        f"{', '.join(unused[:5])}{more}")

    def _build_layer(self, reader: _WeightReader, i: int) -> dict:
        c, pre = self.config, f"transformer.h.{i}."
        take = reader.take
        H, h, g, D = c.hidden_size, c.num_heads, c.attn_heads_kv, c.attn_head_dim
        qkv = reader.matrix(pre + "attn.c_attn.weight")  # [(h + 2g)·D, H] as Linear, in the backend's form
        if _out_in_shape(qkv, self.backend) != ((h + 2 * g) * D, H):
            raise ModelFileError(f"{pre}attn.c_attn.weight has shape {_out_in_shape(qkv, self.backend)}, expected "
                                 f"{((h + 2 * g) * D, H)} ({c.architecture}, {h} heads, {g} KV heads)")
        return {
            "ln_1": (take(pre + "ln_1.weight"), take(pre + "ln_1.bias")),
            "qkv": qkv, "qkv_bias": take(pre + "attn.c_attn.bias"),
            "o": reader.matrix(pre + "attn.c_proj.weight"), "o_bias": take(pre + "attn.c_proj.bias"),
            "ln_2": (take(pre + "ln_2.weight"), take(pre + "ln_2.bias")),
            "fc": reader.matrix(pre + "mlp.c_fc.weight"), "fc_bias": take(pre + "mlp.c_fc.bias"),
            "proj": reader.matrix(pre + "mlp.c_proj.weight"), "proj_bias": take(pre + "mlp.c_proj.bias"),
        }

    def prepare_decode_stack(self) -> None:
        """Llama's one-call C++ layer stack has no GPT-2 form: layers run one by one."""

    def num_weight_bytes(self) -> int:
        tensors = [self.wte, self.wpe, *self.ln_f]
        for layer in self.layers:
            tensors += [t for v in layer.values() for t in (v if isinstance(v, tuple) else (v,))]
        tensors += [t for el in self._el for t in el.values() if t is not None]
        tensors = [u for t in tensors for u in (t.tensors() if isinstance(t, QuantizedLinear) else [t])]
        return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())

    def _norm(self, x: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), ln[0], ln[1], self.config.layer_norm_eps)

    def _attention(self, i: int, layer: dict, x: torch.Tensor, attention, el: bool) -> torch.Tensor:
        """x = ln_1(h) [T, H] -> the heads' outputs [T, h·D]."""
        c = self.config
        T = x.shape[0]
        h, g, D = c.num_heads, c.attn_heads_kv, c.attn_head_dim
        scale = 1.0 / math.sqrt(D) if c.scale_attn_weights else 1.0
        if not el:
            qkv = self.product(x, layer["qkv"]) + layer["qkv_bias"]
            q = qkv[:, : h * D].view(T, h, D)
            k = qkv[:, h * D : (h + g) * D].view(T, g, D)
            v = qkv[:, (h + g) * D :].view(T, g, D)
            return attention.attend(i, q, k, v, scale).reshape(T, h * D)
        el_w = self._el_weights(i)
        Hd, p = c.hidden_size, h // g
        if el_w["q"] is None:  # quantized c_attn: its whole product, sliced
            q = (self.product(x, layer["qkv"]) + layer["qkv_bias"])[:, : h * D].reshape(T, h, D)
        else:
            q = (self.product(x, el_w["q"]) + el_w["q_bias"]).view(T, h, D)

        def expand(qd: torch.Tensor) -> torch.Tensor:  # [B, h, D] -> q̃ = W_K,h · q_h [B, h, Hd]
            B = qd.shape[0]
            return torch.einsum("bgpd,gdh->bgph", qd.float().view(B, g, p, D), el_w["w_k"]).reshape(B, h, Hd).to(x.dtype)

        def unexpand(sums: torch.Tensor) -> torch.Tensor:  # Σ_j p_j x_j [B, h, Hd] -> W_V,h · sums + b_V,h [B, h, D]
            B = sums.shape[0]
            out = torch.einsum("bgph,gdh->bgpd", sums.float().view(B, g, p, Hd), el_w["w_v"])
            return (out + el_w["b_v"][None, :, None, :]).to(x.dtype).reshape(B, h, D)

        def kv_of(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Hd] -> k, v [S, g, D]
            if el_w["kv"] is None:
                kv = (self.product(xs, layer["qkv"]) + layer["qkv_bias"])[:, h * D :]
            else:
                kv = self.product(xs, el_w["kv"]) + el_w["kv_bias"]
            return kv[:, : g * D].reshape(-1, g, D), kv[:, g * D :].reshape(-1, g, D)

        return attention.attend_el(i, x, q, expand, unexpand, kv_of, g, scale).reshape(T, h * D)

    def _el_weights(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's EL-attention weights, made on first use (only EL engines pay their memory): the
        q and k/v parts of c_attn as products, W_K,h and W_V,h per KV head [g, D, H] float32, b_V."""
        if not self._el:
            c = self.config
            h, g, D, H = c.num_heads, c.attn_heads_kv, c.attn_head_dim, c.hidden_size
            in_out = self.backend.weight_layout == "in_out"
            for layer in self.layers:
                w, b = layer["qkv"], layer["qkv_bias"]
                quantized = isinstance(w, QuantizedLinear)  # its products stay whole (sliced after); W_K, W_V dense
                w_out_in = w.dequantize() if quantized else (w.t() if in_out else w)  # [(h + 2g)·D, H]

                def rows(a: int, z: int) -> torch.Tensor | None:  # output rows [a, z) as a product's weight
                    return None if quantized else (w[:, a:z] if in_out else w[a:z]).contiguous()

                self._el.append({
                    "q": rows(0, h * D), "q_bias": b[: h * D],
                    "kv": rows(h * D, (h + 2 * g) * D), "kv_bias": b[h * D :],
                    "w_k": w_out_in[h * D : (h + g) * D].float().reshape(g, D, H),
                    "w_v": w_out_in[(h + g) * D :].float().reshape(g, D, H),
                    "b_v": b[(h + g) * D :].float().view(g, D),
                })
        return self._el[i]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attention,
        logits_rows: torch.Tensor | None = None,  # which of the T rows need logits; None: all
    ) -> torch.Tensor:  # [len(logits_rows) or T, V] float32
        if positions.numel() and int(positions.max()) >= self.config.max_position_embeddings:
            raise ModelFileError(f"position {int(positions.max())} is past {self.config.architecture}'s "
                                 f"{self.config.max_position_embeddings} learned positions")
        el = bool(getattr(getattr(attention, "kv", None), "shares_values", False))
        x = self.wte[input_ids] + self.wpe[positions]  # [T, H]
        approx = self.config.activation
        for i, layer in enumerate(self.layers):
            a = self._attention(i, layer, self._norm(x, layer["ln_1"]), attention, el)
            x = x + (self.product(a, layer["o"]) + layer["o_bias"])
            m = F.gelu(self.product(self._norm(x, layer["ln_2"]), layer["fc"]) + layer["fc_bias"], approximate=approx)
            x = x + (self.product(m, layer["proj"]) + layer["proj_bias"])
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self.product(self._norm(x, self.ln_f), self.lm_head).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        return logits
