"""The Llama family (MHA, GQA, MQA; Llama-3 RoPE; optional attention and MLP biases) and Qwen2
(q/k/v biases) as plain PyTorch.

The model never owns a KV cache: each forward is handed an attention object (see
`forklm/attention/forked.py`) that stores the new K/V and attends over whatever layout the
engine uses. Numerics follow Hugging Face transformers' implementation step for step (RMSNorm
in float32, RoPE tables in float32 cast to the model dtype) so that logits match it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from forklm.config import ModelConfig, RopeConfig
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.backend import Backend, head_format
from forklm.models.quant import (
    BlockLinear,
    BlockQuantized,
    GGMLWeights,
    QuantizedLinear,
    build_matrix,
    linear,
)


class StepAttention(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, h, D], k/v [T, g, D] of the new tokens -> attention output [T, h, D]."""
        ...

    # Optional: an attention with `fuses_rope` True takes the q/k/v product's rows [T, (h + 2g)·D]
    # and the rotary tables [T, 1, D] in `attend_qkv(layer, qkv, cos, sin_signed)` -> [T, h·D]
    # (rotary and the K/V write its own business).


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32), with linear or Llama-3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, with sin_signed = [-sin1, sin2]: rolling x by
    half a head gives [x2, x1], and (-x2)·sin1 = x2·(-sin1) exactly. x [T, heads, D], cos/sin [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operator by operator (the test oracle of `rms_norm`)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it (in float32, rounded to x's dtype, then times the
    weight in x's dtype), through PyTorch's rms_norm: 3 calls from Python instead of 7."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def _linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w_t [in, out] (+ bias), weights kept transposed."""
    if bias is None:
        return torch.matmul(x, w_t)
    return torch.addmm(bias, x, w_t)


def _linear_out_in(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w [out, in]ᵀ (+ bias): the checkpoint's own layout."""
    return F.linear(x, w, bias)


class _WeightReader:
    """Takes a checkpoint's tensors by name (each once) into the form the backend runs them in."""

    def __init__(self, weights: dict, backend: Backend) -> None:
        self.weights, self.backend = weights, backend

    def raw(self, name: str) -> torch.Tensor | BlockQuantized:
        if name not in self.weights:
            raise ModelFileError(f"checkpoint is missing tensor {name!r}")
        return self.weights.pop(name)

    def take(self, name: str) -> torch.Tensor:
        """A dense tensor in the model dtype (GGUF blocks dequantized: the float loader's values exactly)."""
        w = self.raw(name)
        if isinstance(w, (BlockQuantized, GGMLWeights)):
            w = w.dequantize()
        return w.to(device=self.backend.device, dtype=self.backend.dtype)

    def transposed(self, w: torch.Tensor) -> torch.Tensor:
        """A dense [out, in] weight in the backend's layout."""
        return w.t().contiguous() if self.backend.weight_layout == "in_out" else w.contiguous()

    def matrix(self, *names: str, how: str | None | bool = True) -> torch.Tensor | QuantizedLinear:
        """Weights fused along `out` in their run-time format (`how`: True for the backend's quantization)."""
        how = self.backend.quantize if how is True else how
        if self.backend.quantize is None:
            return self.transposed(torch.cat([self.take(n) for n in names], dim=0))
        w = build_matrix([self.raw(n) for n in names], how, self.backend)
        return w if isinstance(w, QuantizedLinear) else self.transposed(w)


def token_table(reader: _WeightReader, shape: tuple[int, int], tied: bool):
    """(embed, embed_rows, tied_head) of model.embed_tokens.weight [V, H]: the table dense (`embed`), or
    `embed_rows` (ids -> float32 rows) over a table kept quantized; tied_head: the LM head's quantized
    weights where the head is tied to the table (its rows are then looked up in them, exactly)."""
    backend, quantize = reader.backend, reader.backend.quantize
    embed = embed_rows = tied_head = None
    if quantize is not None and tied:
        tied_head = build_matrix([reader.raw("model.embed_tokens.weight")], head_format(quantize), backend)
        if isinstance(tied_head, QuantizedLinear) and tied_head.dense is None:
            embed_rows = tied_head.dequantize_rows
        else:
            embed = tied_head.dense if isinstance(tied_head, QuantizedLinear) else tied_head
            if isinstance(tied_head, BlockLinear) and embed.dtype != backend.dtype:
                embed_rows = tied_head.dequantize_rows  # a bfloat16 dense copy: look up exact rows
        embed_shape = tuple(tied_head.shape)
    elif quantize == "gguf" and isinstance(reader.weights.get("model.embed_tokens.weight"), GGMLWeights):
        table = reader.raw("model.embed_tokens.weight")  # kept as stored; rows dequantized on lookup
        embed_rows, embed_shape = table.dequantize_rows, table.shape
    else:
        embed = reader.take("model.embed_tokens.weight")  # [V, H]
        embed_shape = tuple(embed.shape)
    if tuple(embed_shape) != tuple(shape):
        raise ModelFileError(f"model.embed_tokens.weight has shape {tuple(embed_shape)}, config says {tuple(shape)}")
    return embed, embed_rows, tied_head


def weight_bytes_read(w, rows: int) -> int:
    """Bytes a product of `rows` rows reads of weight w: a QuantizedLinear's packed weights and scales
    up to its `max_rows`, its dense copy above; a dense tensor whole."""
    if isinstance(w, QuantizedLinear):
        if w.dense is not None and rows > w.max_rows:
            return w.dense.numel() * w.dense.element_size()
        return sum(u.numel() * u.element_size() for u in w.kernel_tensors())
    return w.numel() * w.element_size()


def embed_tokens(embed: torch.Tensor | None, embed_rows, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows [T, H] of `ids` from a `token_table`."""
    return embed[ids] if embed_rows is None else embed_rows(ids).to(dtype)


class LlamaModel:
    """Weights plus a forward pass; fused q/k/v and gate/up projections (one GEMM each).

    Every tensor of the checkpoint is used or refused: biases the config asks for are applied, a
    tensor the model has no place for is an error naming it (never dropped silently).
    `num_valid_tokens`: ids at or above it get logit -inf, so a vocabulary padded beyond the
    tokenizer's (Qwen2: 151936 rows for ~151665 tokens) never yields an id that decodes to nothing.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: Backend) -> None:
        self.config = config
        self.backend = backend  # dtype, device, weight formats and kernels: resolved once (forklm/backend.py)
        backend.for_model(config.head_dim)
        self.dtype, self.device, self.quantize = backend.dtype, backend.device, backend.quantize
        self.num_valid_tokens = config.vocab_size  # LLM lowers it to the tokenizer's size
        self.quantized_kernels = backend.quantized_kernels  # they take [out, in]
        self.weight_layout = backend.weight_layout
        self._linear = _linear if self.weight_layout == "in_out" else _linear_out_in
        if self.quantized_kernels:
            self._linear = linear  # QuantizedLinear or a dense [out, in] weight
        reader = _WeightReader(weights, backend)
        tied = not ("lm_head.weight" in weights and not config.tie_word_embeddings)
        tied_head = self._build_embedding(reader, tied)
        self.layers: list[dict[str, torch.Tensor | None]] = [self._build_layer(reader, i) for i in range(config.num_layers)]
        self.norm = reader.take("model.norm.weight")
        if not tied:
            self.lm_head = reader.matrix("lm_head.weight", how=head_format(self.quantize))  # [H, V]
        else:
            weights.pop("lm_head.weight", None)
            # tied: a transposed copy for "in_out", the table itself for "out_in"
            if isinstance(tied_head, QuantizedLinear):
                self.lm_head = tied_head
            else:
                self.lm_head = reader.transposed(self.embed) if self.weight_layout == "in_out" else self.embed
        c = config
        self._decode_stack = None  # every layer in one C++ call (kernels/decode_stack.py), built on first use
        self._decode_stack_checked = False
        if backend.block_kernel and backend.decode_kernel == "cpu":
            from forklm.kernels import decode_stack

            why = decode_stack.unsupported_reason(self)
            if why is not None:
                backend.fallbacks.append(f"decode steps run layer by layer, not in one C++ call (the decode stack): {why}")
        self.inv_freq = rope_inv_freq(c.rope, c.head_dim).to(self.device)
        self._rope_len = 0  # positions the cos/sin tables cover (see _rope)
        self._cos = self._sin_signed = torch.empty(0)
        unused = sorted(n for n in weights if not n.endswith("rotary_emb.inv_freq"))  # old files store RoPE tables
        if unused:
            more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
            raise UnsupportedModelError(
                f"checkpoint has tensors a {c.architecture} model with attention_bias={c.attention_bias}, "
                f"mlp_bias={c.mlp_bias} does not use: {', '.join(unused[:5])}{more}"
            )

    def _build_embedding(self, reader: _WeightReader, tied: bool):
        """The token table (`token_table`); returns the tied LM head's quantized weights, or None."""
        c = self.config
        self.embed, self._embed_rows, tied_head = token_table(reader, (c.vocab_size, c.hidden_size), tied)
        return tied_head

    def _build_layer(self, reader: _WeightReader, i: int) -> dict[str, torch.Tensor | None]:
        c, pre = self.config, f"model.layers.{i}."
        take, matrix = reader.take, reader.matrix
        qkv_bias = gate_up_bias = down_bias = None
        if c.attention_bias:
            qkv_bias = torch.cat([take(pre + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
        if c.mlp_bias:
            gate_up_bias = torch.cat([take(pre + "mlp.gate_proj.bias"), take(pre + "mlp.up_proj.bias")], dim=0)
            down_bias = take(pre + "mlp.down_proj.bias")
        return {
            "attn_norm": take(pre + "input_layernorm.weight"),
            "qkv": matrix(*(pre + f"self_attn.{n}_proj.weight" for n in "qkv")),  # [H, (h + 2g)·D] ("in_out")
            "qkv_bias": qkv_bias,
            "o": matrix(pre + "self_attn.o_proj.weight"),  # [h·D, H]
            "o_bias": take(pre + "self_attn.o_proj.bias") if c.o_proj_bias else None,
            "mlp_norm": take(pre + "post_attention_layernorm.weight"),
            "gate_up": matrix(pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"),  # [H, 2I]
            "gate_up_bias": gate_up_bias,
            "down": matrix(pre + "mlp.down_proj.weight"),  # [I, H]
            "down_bias": down_bias,
        }

    def num_weight_bytes(self) -> int:
        """Bytes of all weight tensors held (the embedding table and, when tied, its transposed copy;
        a quantized weight's packed values, scales and dense copy)."""
        tensors = [t for t in (self.embed, self.norm, self.lm_head) if t is not None]
        tensors += [t for layer in self.layers for t in layer.values() if t is not None]
        tensors = [u for t in tensors for u in (t.tensors() if isinstance(t, QuantizedLinear) else [t])]
        unique = {t.data_ptr(): t for t in tensors}  # a tied lm_head may be the embedding itself
        return sum(t.numel() * t.element_size() for t in unique.values())

    def step_weight_bytes(self, rows: int) -> int:
        """Weight bytes a forward of `rows` rows reads: every matrix once in the form that runs at
        that many rows (a QuantizedLinear's packed weights and scales up to its `max_rows`, its dense
        copy above), norms and biases; the embedding table only as a separate LM head reads it."""
        tensors = [self.norm, self.lm_head] + [t for layer in self.layers for t in layer.values() if t is not None]
        return sum(weight_bytes_read(t, rows) for t in tensors)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) [T, 1, D] in the model dtype for these positions (see apply_rope), from
        tables computed as transformers computes each position (float32, then rounded), grown on demand."""
        if positions.device.type != "cpu":  # no table: its size check would sync with the device
            return self._rope_tables(positions)
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._rope_len:
            size = max(need, 2 * self._rope_len, 4096)
            self._cos, self._sin_signed = self._rope_tables(torch.arange(size, device=positions.device))
            self._rope_len = size
        return self._cos[positions], self._sin_signed[positions]

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)  # [T, 1, D]

    # The three shapes of product in a layer. On forklm's block kernel (`BlockLinear`, rows within its
    # `max_rows`, no bias) the operator before the product (RMSNorm, SwiGLU) runs inside the kernel's
    # activation quantization and the residual add inside its output: one call instead of 3-5 small
    # operators; otherwise the same steps as separate operators.
    @staticmethod
    def _fuses(w, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return isinstance(w, BlockLinear) and bias is None and x.shape[0] <= w.max_rows and x.dtype == torch.float32

    def _norm_linear(self, x: torch.Tensor, norm: torch.Tensor, eps: float, w, bias) -> torch.Tensor:
        """linear(rms_norm(x)) (+ bias, added after the product as the decode stack adds it)"""
        if self._fuses(w, x, None) and (bias is None or bias.dtype == torch.float32):
            y = w.kernel(x, norm_weight=norm, eps=eps)
            return y if bias is None else y + bias
        return self._linear(rms_norm(x, norm, eps), w, bias)

    def _linear_add(self, a: torch.Tensor, w, bias, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(a)"""
        if self._fuses(w, a, bias):
            return w.kernel(a, residual=residual)
        return residual + self._linear(a, w, bias)

    def _swiglu_linear_add(self, gate_up: torch.Tensor, w, bias, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(silu(gate) * up) for gate_up = [gate | up]"""
        if self._fuses(w, gate_up, bias):
            return w.kernel(gate_up, swiglu=True, residual=residual)
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self._linear(F.silu(gate) * up, w, bias)

    def prepare_decode_stack(self):
        """The model's `DecodeStack` (kernels/decode_stack.py), built on the first call (the engine
        calls this when it starts, so no request waits for the build), or None where it does not run."""
        if not self._decode_stack_checked:
            from forklm.kernels import decode_stack

            self._decode_stack = decode_stack.build(self)
            self._decode_stack_checked = True
        return self._decode_stack

    def _decode_stack_for(self, rows: int):
        """The model's `DecodeStack` when a step of this many rows runs on it, else None."""
        stack = self.prepare_decode_stack()
        return stack if stack is not None and rows <= stack.max_rows else None

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: StepAttention,
                fused: bool) -> torch.Tensor:
        """x [T, H] through every layer, one product and one attention call at a time."""
        c = self.config
        h, g, D = c.num_heads, c.num_kv_heads, c.head_dim
        T = x.shape[0]
        eps = c.rms_norm_eps
        for i, layer in enumerate(self.layers):
            qkv = self._norm_linear(x, layer["attn_norm"], eps, layer["qkv"], layer["qkv_bias"])
            if fused:
                a = attention.attend_qkv(i, qkv, cos, sin)  # [T, h·D]
            else:
                qk = apply_rope(qkv[:, : (h + g) * D].view(T, h + g, D), cos, sin)  # q and k heads in one pass
                q, k = qk[:, :h], qk[:, h:]
                v = qkv[:, (h + g) * D :].view(T, g, D)
                a = attention.attend(i, q, k, v)  # [T, h, D]
            x = self._linear_add(a.reshape(T, h * D), layer["o"], layer["o_bias"], x)
            gate_up = self._norm_linear(x, layer["mlp_norm"], eps, layer["gate_up"], layer["gate_up_bias"])
            x = self._swiglu_linear_add(gate_up, layer["down"], layer["down_bias"], x)
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attention: StepAttention,
        logits_rows: torch.Tensor | None = None,  # which of the T rows need logits; None: all
    ) -> torch.Tensor:  # [len(logits_rows) or T, V] float32
        T = input_ids.shape[0]
        x = embed_tokens(self.embed, self._embed_rows, input_ids, self.dtype)  # [T, H]
        cos, sin = self._rope(positions)
        # a decode step on the CPU kernel: rotary, K/V write and attention in one call per layer
        fused = getattr(attention, "fuses_rope", False) and x.dtype == torch.float32
        stack = self._decode_stack_for(T) if fused else None
        if stack is not None:  # and the layers' products with it: `_layers` in one C++ call
            x = attention.run_layers(stack.kernel, x, cos, sin)
        else:
            x = self._layers(x, cos, sin, attention, fused)
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self._norm_linear(x, self.norm, self.config.rms_norm_eps, self.lm_head, None).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")  # padding rows: no token has these ids
        return logits
