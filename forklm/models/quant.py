"""Weights kept quantized at run time: int8 per-output-channel and int4 group-wise weight-only
formats over PyTorch's CPU kernels, and a GGUF file's blocks kept as stored: Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 / Q2_K-Q6_K / IQ4_NL / IQ4_XS / BF16 / F16 on forklm's block kernel (`BlockLinear`), every other
type ggml runs on ggml's dot products (`GGMLLinear`).

Formats (w: a weight [out, in]; x: activations [T, in]; y = x @ wᵀ):
    int8   w = q · s[out]                        q int8 in [-127, 127], s per output channel;
           `torch.ops.aten._weight_int8pack_mm(x, q [out, in], s [out])`
    int4   w = (q − 8) · scale[g, out] + zero[g, out]   q in 0..15, groups of 32 along `in`;
           `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros [in/32, out, 2])`
           (the packed layout from `_convert_weight_to_int4pack_for_cpu(q int32 [out, in], 2)`).
    Where the block kernel does not run (a bfloat16 model, no AVX2), quantize="gguf" maps
    GGUF Q4_1 (w = d·q + m per block of 32, q in 0..15) to int4 with scale = d and zero = m + 8d:
           the same q, no re-rounding of the weights (the test checks the dequantized weights equal
           the float loader's bit for bit where the scales are held in float32).
    GGUF Q8_0 (w = d·q per block of 32, q int8) has no exact PyTorch kernel (the int8 kernel scales
           per output channel only): it is re-quantized to int8 per channel (lossy, reported in the
           README); a tied embedding looks its rows up in the same re-quantized weights.

Which format a weight takes, and up to how many rows a kernel runs, is the backend's decision
(forklm/backend.py: `build_matrix` receives the model's `Backend`); this module holds the formats.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from forklm.backend import (
    Backend,
    block_dense_dtype,
    block_kernel_available,
    block_kernel_max_rows,
    kernel_dtype,
    kernel_max_rows,
)
from forklm.errors import InvalidArgumentError, UnsupportedModelError
from forklm.kernels.ggml_gemm import GGMLWeights

GROUP_SIZE = 32  # int4 group along `in`; GGUF Q4_1's block, and no slower than 64 on this CPU


# ----------------------------------------------------------------------------- GGUF blocks as stored
@dataclass
class BlockQuantized:
    """A GGUF tensor kept as its blocks (32 values along `in` per block), rows as in HF ([out, in]).

    q4_1: q uint8 [out, in] in 0..15, d and m float32 [out, in/32]: w = d·q + m.
    q5_1: as q4_1 with q in 0..31.
    q8_0: q int8 [out, in], d float32 [out, in/32], m None: w = d·q.
    d and m are the file's float16 values, widened exactly.
    """

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    BLOCK = 32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], computed as gguf's numpy dequantization does ((d·q) + m in float32)."""
        from forklm.kernels.block_gemm import dequantize_values

        return dequantize_values(self.q, self.d, self.m)

    def rows(self, index: torch.Tensor) -> BlockQuantized:
        return BlockQuantized(self.kind, self.q[index], self.d[index], None if self.m is None else self.m[index])

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse GGUF tensors of different types {sorted(kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return BlockQuantized(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def to_block_weights(self):
        """The layout forklm's block kernel reads (`forklm.kernels.block_gemm.BlockWeights`)."""
        from forklm.kernels import block_gemm

        if self.kind == "q4_1":
            return block_gemm.pack_q4_1_r8(self.q, self.d, self.m)
        if self.kind == "q5_1":
            return block_gemm.pack_q5_1(self.q, self.d, self.m)
        return block_gemm.pack_q8_0_r8(self.q, self.d)


def read_gguf_blocks(kind_name: str, raw, shape: tuple[int, int]) -> BlockQuantized:
    """Q4_1, Q4_0 or Q8_0 bytes of a GGUF tensor ([rows, bytes per row] uint8) -> BlockQuantized
    [out, in] (Q4_0 as Q4_1 blocks with minimum −8d: the same values, exactly)."""
    import numpy as np

    n, k = shape
    nb = k // 32
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, -1)
    if kind_name == "Q4_1":  # per block: d fp16, m fp16, 16 bytes: value j low nibble, value j+16 high nibble
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        return BlockQuantized("q4_1", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    if kind_name == "Q4_0":  # per block: d fp16, 16 bytes as Q4_1's; w = d·(q − 8) = d·q + (−8d), exactly
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        return BlockQuantized("q4_1", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(-8 * d))
    if kind_name == "Q8_0":  # per block: d fp16, 32 int8
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:34].copy().view(np.int8).reshape(n, k)
        return BlockQuantized("q8_0", torch.from_numpy(q), torch.from_numpy(d))
    raise ValueError(f"GGUF type {kind_name} is not kept quantized")


# ----------------------------------------------------------------------------- run-time formats
class QuantizedLinear:
    """y = x @ wᵀ (+ bias) with w [out, in] held as int8 or int4 for PyTorch's CPU kernels, and,
    when `dense` is set, the same dequantized weights in the model dtype for steps of more than
    `max_rows` rows (where a dense product measures faster)."""

    def __init__(self, kind: str, qweight: torch.Tensor, scales: torch.Tensor, out_features: int,
                 in_features: int, dtype: torch.dtype, max_rows: int | None = None, keep_dense: bool = True,
                 values: torch.Tensor | None = None,  # values: the dequantized weights, if at hand
                 dense_dtype: torch.dtype | None = None):  # the model's dtype; None: `dtype`
        self.kind = kind  # "int8" | "int4"
        self.qweight = qweight  # int8 [out, in] | int4-packed uint8 [out, in/2]
        self.scales = scales  # int8: [out]; int4: [in/32, out, 2] (scale, zero), in `dtype`
        self.out_features = out_features
        self.in_features = in_features
        self.dtype = dtype  # the kernel's activations and scales
        self.dense_dtype = dense_dtype or dtype  # the model's activations and the dense copy
        if max_rows is None:
            max_rows = kernel_max_rows(kind, out_features, self.dense_dtype)
        self.max_rows = max_rows
        self.dense = None
        if keep_dense:
            self.dense = (self.dequantize() if values is None else values).to(self.dense_dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP_SIZE, self.scales)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.max_rows:
            return F.linear(x, self.dense, bias)
        if x.dtype == self.dtype:
            y = self.kernel(x.contiguous())
        else:  # a float32 model: activations rounded to the kernel's bfloat16, the product widened back
            y = self.kernel(x.to(self.dtype)).to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: exactly the weights the kernel multiplies by (scales as held)."""
        if self.kind == "int8":
            return self.qweight.float() * self.scales.float().unsqueeze(1)
        padded = self.scales.shape[1]  # rows padded to a multiple of 64 (see _int4)
        return _int4_values(unpack_int4(self.qweight, padded, self.in_features), self.scales)[: self.out_features]

    def kernel_tensors(self) -> list[torch.Tensor]:
        """What the kernel reads (packed weights and scales)."""
        return [self.qweight, self.scales]

    def tensors(self) -> list[torch.Tensor]:
        return self.kernel_tensors() + ([self.dense] if self.dense is not None else [])

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __repr__(self) -> str:
        dense = f", dense copy {self.dense.dtype}" if self.dense is not None else ""
        return (f"QuantizedLinear({self.kind}, out={self.out_features}, in={self.in_features}, "
                f"kernel for T <= {self.max_rows}{dense})")


class BlockLinear(QuantizedLinear):
    """y = x @ wᵀ with w [out, in] kept as a GGUF file's blocks in one of the block kernel's layouts
    (`forklm.kernels.block_gemm.BlockWeights`: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K-Q6_K / IQ4_NL / IQ4_XS,
    every value as stored), run by forklm's AVX2 integer kernel (activations quantized per row
    and block of 32, as llama.cpp does; each row's result depends on that row alone) at every row
    count. A fused matrix whose parts take different layouts (a Q5_0 q beside a Q8_0 v) holds one
    BlockWeights per run of parts (`parts`), multiplied one after the other into their columns.
    keep_dense=True (opt-in, no file's default path) adds a dense copy (`block_dense_dtype()`) for
    steps of more than `max_rows` rows. The model's activations are float32 either way."""

    stored_types: list[str] | None = None  # the GGUF types of the fused parts, where loaded from a file

    def __init__(self, blocks, dense_dtype: torch.dtype | None = None, max_rows: int | None = None,
                 keep_dense: bool = False):
        self.parts = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]  # BlockWeights, along out
        if len({p.k for p in self.parts}) != 1:
            raise ValueError("fused block parts must share in_features")
        self.blocks = self.parts[0] if len(self.parts) == 1 else None  # the one part, where there is one
        self.kind = "+".join(dict.fromkeys(p.kind for p in self.parts))  # "q4_1", "q5_1+q8_0", ...
        self.out_features, self.in_features = sum(p.n for p in self.parts), self.parts[0].k
        self.dtype = torch.float32  # the kernel's activations (and the model's)
        self.dense_dtype = dense_dtype or block_dense_dtype()
        if max_rows is None:  # with a dense copy: the measured crossover; without: every row count
            max_rows = block_kernel_max_rows(self.out_features, self.dense_dtype) if keep_dense else sys.maxsize
        self.max_rows = max_rows
        self.dense = self.dequantize().to(self.dense_dtype) if keep_dense else None

    def kernel(self, x: torch.Tensor, **fusions) -> torch.Tensor:
        """float32 x; fusions: a prologue / residual (`block_gemm.gemm`'s keywords)."""
        from forklm.kernels import block_gemm

        if self.blocks is not None:
            return block_gemm.gemm(x, self.blocks, **fusions)
        outs, first = [], 0  # each part into its columns (the decode stack runs the same calls)
        residual = fusions.pop("residual", None)
        for p in self.parts:
            r = None if residual is None else residual[:, first:first + p.n]
            outs.append(block_gemm.gemm(x, p, residual=r, **fusions))
            first += p.n
        return torch.cat(outs, dim=1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > self.max_rows:
            if x.dtype == self.dense.dtype:
                return F.linear(x, self.dense, bias)
            y = F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)  # float32 rows on a bfloat16 copy
        else:
            y = self.kernel(x.float())
            y = y if x.dtype == torch.float32 else y.to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows `ids` of the weights, exact (an embedding lookup in a table
        whose dense copy is rounded to bfloat16)."""
        if self.blocks is None:
            raise ValueError("row lookups are for a single (unfused) table")
        return self.blocks.dequantize_rows(ids)

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]


class GGMLLinear(QuantizedLinear):
    """y = x @ wᵀ (+ bias) with w [out, in] kept as a GGUF file's bytes (often the memory-mapped file
    itself), run by ggml's own dot products (`forklm.kernels.ggml_gemm`) at every row count: no dense
    copy, each row's result that row's alone. The parts of a fused matrix (q/k/v, gate/up) keep their
    own types (a Q4_K_M file stores attn_v as Q6_K beside Q4_K q and k)."""

    def __init__(self, parts: list[GGMLWeights]):
        from forklm.kernels import ggml_gemm

        if len({p.k for p in parts}) != 1:
            raise ValueError("fused GGUF tensors must share in_features")
        self.parts = parts
        self.stored_types = [p.type_name for p in parts]
        self.kind = "+".join(dict.fromkeys(p.kind for p in parts))
        self.out_features, self.in_features = sum(p.n for p in parts), parts[0].k
        self.dtype = self.dense_dtype = torch.float32  # the kernel's activations
        self.max_rows = sys.maxsize
        self.dense = None
        self._gemm = ggml_gemm._extension().gemm_parts
        self._args = ([p.data for p in parts], [p.type_id for p in parts], [p.output_columns() for p in parts],
                      self.in_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, *self._args)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel(x if x.dtype == torch.float32 else x.float())
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows `ids` (an embedding lookup in the table the LM head reads)."""
        if len(self.parts) != 1:
            raise ValueError("row lookups are for a single (unfused) table")
        return self.parts[0].dequantize_rows(ids)

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.parts]


def stored_block_quantized(w: GGMLWeights) -> BlockQuantized:
    """A GGUF Q4_1 / Q8_0 tensor's stored bytes as BlockQuantized (Hugging Face row order)."""
    raw = w.stored_rows(torch.arange(w.n)) if w.row_order is not None else w.data
    return read_gguf_blocks(w.type_name, raw.numpy(), (w.n, w.k))


# GGUF types forklm's block kernel runs, by the layout they take there (`stored_block_weights`)
BLOCK_KERNEL_TYPES = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q5_0": "q5_1", "Q5_1": "q5_1", "Q8_0": "q8_0_r8",
                      "Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
                      "IQ4_NL": "iq4_nl_r8", "IQ4_XS": "iq4_xs", "BF16": "bf16", "F16": "f16"}


def block_kernel_kind(type_names) -> str | None:
    """The block-kernel layout one fused matrix of these GGUF types takes, or None where it takes none:
    Q4_0 / Q4_1 parts as q4_1 (run interleaved: q4_0_r8 where every part is Q4_0, else q4_1_r8), with a
    Q5_0 / Q5_1 part among them as q5_1 (the 4-bit parts' fifth bits 0); Q4_K parts as q4_k, with a Q5_K part as q5_k; Q6_K / Q3_K / Q2_K parts as q6_k / q3_k /
    q2_k; Q8_0 parts as q8_0_r8, IQ4_NL parts as iq4_nl_r8 (8 outputs interleaved); IQ4_XS parts as iq4_xs;
    BF16 / F16 parts as bf16 / f16 (the values as stored)."""
    kinds = {BLOCK_KERNEL_TYPES.get(t) for t in type_names}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()
    return {frozenset({"q4_1", "q5_1"}): "q5_1", frozenset({"q4_k", "q5_k"}): "q5_k"}.get(frozenset(kinds))


def stored_block_weights(parts: list[GGMLWeights], interleave_k: bool | None = None):
    """GGUF parts fused along `out`, in the block kernel's layout (`block_kernel_kind`,
    `block_gemm.BlockWeights`), repacked from the stored bytes in one C++ pass (`repack_rows`): every
    value as stored. Q4_0 / Q4_1 / Q5_0 / Q5_1 keep GGUF's nibbles (value j in the low nibble of byte j,
    value j + 16 in the high one) and fifth bits, Q8_0's int8 values and IQ4_NL's level indices, 8 outputs
    interleaved (`block_gemm.interleave_r8`'s layouts, written directly by the pass); Q4_0 / Q5_0 alone keep no minima (−8d / −16d applied in
    integers), beside Q4_1 / Q5_1 parts they take minimum −8d / −16d (exact; ValueError where the minimum
    overflows float16); Q4_K / Q5_K values take Q4_1's nibble order, 8 outputs interleaved
    (q4_k_r8 / q5_k_r8) where `interleave_k` (the backend's `interleaved_k_quants`; None: its rule
    `k_quants_interleaved`), else q4_k / q5_k, with their 6-bit scales and minima a byte each (4.6 / 5.6 bits a weight against
    the file's 4.5 / 5.5); Q6_K's low nibbles as Q4_1's and its 2 high bits in planes of their own, 8 outputs
    interleaved (q6_k_r8, 6.56 bits a weight as the file); Q3_K's and Q2_K's
    2-bit fields and Q3_K's third-bit masks as stored, Q3_K's scales an int8 per 16 (3.56 bits a weight
    against the file's 3.44), Q2_K's scale / minimum bytes as stored (2.63 bits, as the file); IQ4_XS's
    level indices as stored, its 6-bit scales an int8 per 32 (4.31 bits against 4.25)."""
    from forklm.kernels import block_gemm

    kind = block_kernel_kind([p.type_name for p in parts])
    if kind is None:
        raise ValueError(f"GGUF types {sorted({p.type_name for p in parts})} take no block-kernel layout together")
    if kind in block_gemm.HALF_KINDS:
        return stored_half_weights(parts, kind)
    if interleave_k is None:
        from forklm.backend import k_quants_interleaved

        interleave_k = k_quants_interleaved()
    n, k = sum(p.n for p in parts), parts[0].k
    nb, nsb = k // 32, k // 256
    only_q4_0 = all(p.type_name == "Q4_0" for p in parts)
    only_q5_0 = all(p.type_name == "Q5_0" for p in parts)  # (Q4_0 and Q5_0 alone keep no minima)
    k_quant = kind in block_gemm.SUPER_BLOCK_KINDS
    two_bit = kind in ("q3_k", "q2_k")  # values as 2-bit planes
    # repacked straight into 8 outputs interleaved (Q4_K / Q5_K where `interleave_k`)
    k_r8 = kind in ("q4_k", "q5_k") and interleave_k  # (ds, dm per super-block; sc, mq a byte per block)
    interleaved = kind in ("q4_1", "q5_1", "q8_0_r8", "iq4_nl_r8", "q6_k") or k_r8
    q6_r8 = kind == "q6_k"  # (ds per super-block; bits 4-5 in planes, scales per 16)
    groups = (n + 7) // 8
    make = torch.zeros if n % 8 else torch.empty  # (the last group's missing outputs zero)
    if interleaved:
        qs = (make(groups, nb, 256, dtype=torch.int8) if kind == "q8_0_r8"
              else make(groups, nb, 128, dtype=torch.uint8))
        d = make(groups, nsb if k_r8 or q6_r8 else nb, 8, dtype=torch.float16)
    else:
        qs = torch.empty(n, k // 4 if two_bit else k // 2, dtype=torch.uint8)
        d = torch.empty(n, 2 * nsb if kind == "q2_k" else nsb if k_quant else nb, dtype=torch.float16)
    m = None if kind in ("q6_k", "q3_k", "q2_k", "q8_0_r8", "iq4_nl_r8", "iq4_xs") or k_r8 else torch.empty(n, nsb if k_quant else nb, dtype=torch.float16)
    qh = torch.zeros(n, nb, dtype=torch.int32) if kind == "q5_k" and not k_r8 else None  # 4-bit parts: fifth bits 0
    if kind == "q5_1" or (kind == "q5_k" and k_r8):  # interleaved: a block's fifth bits in 32 bytes per 8 outputs
        qh = torch.zeros(groups, nb, 32, dtype=torch.uint8)
    sc = mq = q2 = None
    if k_r8:
        m = make(groups, nsb, 8, dtype=torch.float16)  # the super-blocks' −dmin
        sc, mq = make(groups, nb, 8, dtype=torch.uint8), make(groups, nb, 8, dtype=torch.uint8)
    elif kind in ("q4_k", "q5_k"):
        sc, mq = torch.empty(n, nb, dtype=torch.uint8), torch.empty(n, nb, dtype=torch.uint8)
    elif q6_r8:
        sc, q2 = make(groups, nb, 16, dtype=torch.int8), make(groups, nb, 64, dtype=torch.uint8)
    elif kind == "iq4_xs":
        sc = torch.empty(n, nb, dtype=torch.int8)
    elif two_bit:
        sc = torch.empty(n, k // 16, dtype=torch.int8 if kind == "q3_k" else torch.uint8)
        q2 = torch.empty(n, k // 8, dtype=torch.uint8) if kind == "q3_k" else None  # Q3_K's third-bit masks
    from forklm.models.gguf_file import release_pages

    row0 = 0
    for part in parts:  # each in Hugging Face row order (a permuted q / k gathered in the repack's pass)
        if part.n:
            raw = part.data.contiguous()
            order = None if part.row_order is None else part.row_order.to(torch.int64).contiguous()
            if order is not None and order.numel() != part.n:
                raise ValueError(f"a row order of {order.numel()} rows for a part of {part.n}")
            overflowing = block_gemm.repack_rows(part.type_name, raw.view(raw.shape[0], -1), row0, qs, d, m, qh, sc,
                                                 mq, q2, order=order, outputs=n)
            if overflowing and not (only_q4_0 or only_q5_0):  # (alone, their −8d / −16d is applied in integers)
                factor = -8 if part.type_name == "Q4_0" else -16
                raise ValueError(f"{overflowing} {part.type_name} blocks' minimum {factor}d overflows float16")
        row0 += part.n
        if part.mapped:  # the file's pages out of the resident set: its copy and the repacked one never both count
            release_pages(part.data)
    if q6_r8:
        return block_gemm.BlockWeights("q6_k_r8", qs, d, None, n, k, sc=sc, q2=q2, count=torch.tensor([n], dtype=torch.int64))
    if kind in ("q8_0_r8", "iq4_nl_r8"):
        return block_gemm.BlockWeights(kind, qs, d, None, n, k, count=torch.tensor([n], dtype=torch.int64))
    if kind == "iq4_xs":
        return block_gemm.BlockWeights("iq4_xs", qs, d, None, n, k, sc=sc)
    if two_bit:
        return block_gemm.BlockWeights(kind, qs, d, None, n, k, sc=sc, q2=q2)
    if k_r8:
        return block_gemm.BlockWeights(kind + "_r8", qs, d, mq, n, k, qh, sc, m, count=torch.tensor([n], dtype=torch.int64))
    if kind in ("q4_k", "q5_k"):
        return block_gemm.BlockWeights(kind, qs, d, block_gemm.block_minima(mq), n, k, qh, sc,
                                       block_gemm.block_minima(m))
    if interleaved:  # Q4_0 / Q5_0 alone keep no minima: w = d·(q − 8) / d·(q − 16)
        plain = only_q4_0 or only_q5_0
        name = ("q4_0_r8" if only_q4_0 else "q4_1_r8") if kind == "q4_1" else ("q5_0_r8" if only_q5_0 else "q5_1_r8")
        return block_gemm.BlockWeights(name, qs, d, None if plain else block_gemm.block_minima(m), n, k, qh,
                                       count=torch.tensor([n], dtype=torch.int64))
    return block_gemm.BlockWeights(kind, qs, d, block_gemm.block_minima(m), n, k, qh)


def half_matrices_as_stored(weights: dict) -> dict | None:
    """A Hugging Face checkpoint's 2-D bfloat16 / float16 tensors (its matrices and token table) as
    GGUF BF16 / F16 tensors over the same memory (`GGMLWeights`, no copy): the model then keeps them
    as stored, as it keeps a GGUF file's (`backend.keeps_half_matrices` decides when). None where the
    checkpoint has no such tensor or one whose rows are not a multiple of 32 values."""
    types = {torch.bfloat16: "BF16", torch.float16: "F16"}
    halves = {n: w for n, w in weights.items() if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in types}
    if not halves or any(w.shape[1] % 32 for w in halves.values()):
        return None
    out = dict(weights)
    for name, w in halves.items():
        w = w.contiguous()
        out[name] = GGMLWeights(w.view(torch.uint8).view(w.shape[0], -1), types[w.dtype], w.shape[0], w.shape[1])
    return out


def stored_half_weights(parts: list[GGMLWeights], kind: str):
    """GGUF BF16 / F16 parts fused along `out` as the block kernel's bf16 / f16 weights [N, K]: the file's
    own values where the file holds them (often the mapped file itself): one part in the stored row
    order as a matrix, else a table of the parts' rows in Hugging Face order (`gather_half`: no copy)."""
    from forklm.kernels import block_gemm

    dtype = block_gemm.HALF_DTYPES[kind]
    k = parts[0].k
    views = [(p.data.contiguous().view(dtype).view(p.n, k), p.row_order) for p in parts]
    if len(parts) == 1 and parts[0].row_order is None:
        return block_gemm.pack_half(views[0][0])
    return block_gemm.gather_half(views)


def stored_matrix(parts: list[GGMLWeights], block_kernel: bool | None = None, interleave_k: bool | None = None):
    """A GGUF file's tensors fused along `out`, kept as stored (quantize "gguf" on CPU): parts of the
    types the block kernel runs (`BLOCK_KERNEL_TYPES`: Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS, BF16, F16) on it, a
    run of parts per layout (repacked once, `block_kernel_kind`; BF16 / F16 as stored), a matrix with any other
    part (F32, or BF16 / F16 rows not a multiple of 32) on ggml's kernels over the file's bytes. A type neither runs is refused by name, never
    densified. block_kernel: whether the block kernel runs
    here (the backend's `block_kernel`; None: whether it is built); interleave_k: whether Q4_K / Q5_K
    take their interleaved layouts (the backend's `interleaved_k_quants`; None: its rule)."""
    from forklm.kernels import ggml_gemm

    if block_kernel is None:
        block_kernel = block_kernel_available()
    if interleave_k is None:
        from forklm.backend import k_quants_interleaved

        interleave_k = k_quants_interleaved()

    kinds = {p.type_name for p in parts}
    if block_kernel and all(block_kernel_kind([p.type_name]) is not None for p in parts):
        runs: list[list[GGMLWeights]] = []  # consecutive parts that share one layout
        for p in parts:
            if runs and block_kernel_kind([q.type_name for q in runs[-1]] + [p.type_name]) is not None:
                runs[-1].append(p)
            else:
                runs.append([p])
        try:
            packed = [stored_block_weights(run, interleave_k) for run in runs]
        except ValueError:  # a Q4_0 / Q5_0 scale whose minimum overflows float16: ggml's kernel instead
            packed = None
        if packed is not None:
            lin = BlockLinear(packed)
            lin.stored_types = [p.type_name for p in parts]
            return lin
    unknown = sorted(kinds - set(ggml_gemm.GGML_TYPE_IDS))
    if unknown:
        raise UnsupportedModelError(f"GGUF tensor type {unknown[0]} is not supported (forklm runs "
                                    f"{', '.join(ggml_gemm.GGML_TYPE_IDS)})")
    if not ggml_gemm.available():
        raise UnsupportedModelError(
            f"GGUF tensor type {'+'.join(sorted(kinds))} runs on ggml's CPU kernels, which are not available here "
            f"({ggml_gemm.build_error()}); load with quantize=None to run the file dequantized to float")
    return GGMLLinear(parts)


def _int4_values(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """float32 (q − 8)·scale + zero for q [out, in] and scales_and_zeros [in/32, out, 2]."""
    n, k = q.shape
    s = sz.float()
    scale, zero = s[..., 0].t().unsqueeze(-1), s[..., 1].t().unsqueeze(-1)  # [out, in/32, 1]
    return ((q.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8) * scale + zero).view(n, k)


_checked_layouts: set[tuple[int, int]] = set()


@lru_cache(maxsize=1)
def int4_pack_block() -> int:
    """Rows per block of PyTorch's CPU int4 layout: it depends on the CPU capability the kernel was
    dispatched for (64 with AVX-512, 32 with AVX2 in PyTorch 2.13). Found by packing a probe once."""
    probe = torch.arange(64 * 32, dtype=torch.int32).view(64, 32) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    for block in (64, 32):
        if torch.equal(_unpack_blocks(packed, 64, 32, block), probe.to(torch.uint8)):
            return block
    raise RuntimeError("this PyTorch's int4 CPU packing is neither layout forklm reads back")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] in 0..15 -> PyTorch's CPU int4 layout (checked against `unpack_int4` once per
    shape and process)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    if tuple(q.shape) not in _checked_layouts:
        if not torch.equal(unpack_int4(packed, *q.shape), q.to(torch.uint8)):
            raise RuntimeError("this PyTorch's int4 CPU packing differs from the layout forklm reads back")
        _checked_layouts.add(tuple(q.shape))
    return packed


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `_convert_weight_to_int4pack_for_cpu` (PyTorch 2.13, CPU): rows in blocks of B
    (`int4_pack_block()`: 64 on AVX-512, 32 on AVX2); within a block, byte (k, j) holds row j in its
    low nibble and row j + B/2 in its high nibble. `pack_int4` checks this on every weight it packs,
    so a changed layout is an error, not wrong numbers."""
    if out_features % 64:
        raise InvalidArgumentError(f"int4 weights need out_features divisible by 64, got {out_features}")
    return _unpack_blocks(packed, out_features, in_features, int4_pack_block())


def _unpack_blocks(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    b = packed.view(n // block, k, block // 2)
    lo, hi = b & 0x0F, b >> 4
    return torch.cat([lo, hi], dim=2).permute(0, 2, 1).reshape(n, k)


def _check_shape(kind: str, w_shape: tuple[int, int]) -> None:
    n, k = w_shape
    if kind == "int4" and k % GROUP_SIZE:
        raise InvalidArgumentError(
            f"quantize='int4' needs in_features divisible by {GROUP_SIZE}; a weight of shape [{n}, {k}] "
            "has not (use 'int8')"
        )


def int8_from_float(w: torch.Tensor, dtype: torch.dtype, **kw) -> QuantizedLinear:
    """Symmetric per-output-channel int8: s = max|w_row| / 127 (held in `dtype`), q = round(w / s)."""
    w = w.float()
    s = (w.abs().amax(dim=1) / 127).to(dtype)
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(w / s.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return QuantizedLinear("int8", q.contiguous(), s.contiguous(), w.shape[0], w.shape[1], dtype, **kw)


def int4_from_float(w: torch.Tensor, dtype: torch.dtype, **kw) -> QuantizedLinear:
    """Asymmetric int4 per group of 32 along `in` (min/max, as GGUF Q4_1): scale = (max − min)/15,
    zero = min + 8·scale, both rounded to `dtype` first and q chosen against the rounded values."""
    _check_shape("int4", tuple(w.shape))
    n, k = w.shape
    g = w.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(dtype).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.round((g - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return _int4(q, scale, zero, dtype, **kw)


def int4_from_q4_1(b: BlockQuantized, dtype: torch.dtype, **kw) -> QuantizedLinear:
    """GGUF Q4_1 as int4 with the stored q: scale = d, zero = m + 8d (exact in float32 for the
    file's fp16 d and m unless their exponents are > 13 apart, checked; rounded once if dtype is
    bfloat16, which the kernel requires for bfloat16 activations)."""
    _check_shape("int4", b.shape)
    zero = b.m + 8 * b.d
    if not torch.equal((zero.double() - 8 * b.d.double()), b.m.double()):
        raise ValueError("Q4_1 zero point m + 8d is not exact in float32 for this tensor")
    return _int4(b.q, b.d, zero, dtype, **kw)


def _int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype, **kw) -> QuantizedLinear:
    n, k = q.shape
    values = _int4_values(q, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype)) if kw.get("keep_dense", True) else None
    pad = -n % 64  # the packed layout is read back (dequantize) in blocks of 64 rows: pad with zero rows
    if pad:
        q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
        scale = torch.cat([scale, torch.ones(pad, scale.shape[1])])
        zero = torch.cat([zero, torch.zeros(pad, zero.shape[1])])
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [in/32, out, 2]
    return QuantizedLinear("int4", pack_int4(q), sz, n, k, dtype, values=values, **kw)


def quantize_weight(w: torch.Tensor | BlockQuantized, how: str, dtype: torch.dtype, block_kernel: bool = False,
                    **kw) -> QuantizedLinear:
    """One weight [out, in] (float or GGUF blocks) in the run-time format `how` asks for.

    how "int8" / "int4": from the float weights (GGUF blocks are dequantized first); where the block
    kernel runs (`block_kernel`), as Q8_0 / Q4_1 blocks on it (resident once, no dense copy), else
    PyTorch's int8 (per output channel) / int4 kernels with a dense copy for many rows.
    how "gguf": Q4_1 blocks as int4 with their own q; Q8_0 re-quantized to int8 per channel (lossy);
    a float tensor in a GGUF file stays float (returned as is by the caller, not here).
    """
    if isinstance(w, BlockQuantized):
        if how == "gguf" and block_kernel:
            return BlockLinear(w.to_block_weights())
        if how == "gguf":
            if w.kind == "q4_1":
                return int4_from_q4_1(w, dtype, **kw)
            return int8_from_float(w.dequantize(), dtype, **kw)
        w = w.dequantize()
    if how == "int8":
        if w.shape[1] % GROUP_SIZE == 0 and block_kernel:
            return BlockLinear(q8_0_from_float(w).to_block_weights())
        return int8_from_float(w, dtype, **kw)
    if how == "int4":
        if w.shape[1] % GROUP_SIZE == 0 and block_kernel:
            return BlockLinear(q4_1_from_float(w).to_block_weights())
        return int4_from_float(w, dtype, **kw)
    raise InvalidArgumentError(f"cannot quantize a float weight as {how!r}")


def q8_0_from_float(w: torch.Tensor) -> BlockQuantized:
    """A float weight [out, in] as GGUF Q8_0 blocks (what `quantize="int8"` becomes on forklm's block
    kernel): per block of 32 along `in`, d = max|w| / 127 rounded to float16, then q = round(w / d) in
    -127..127 against the rounded d (d = 0: an all-zero block, q = 0)."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise InvalidArgumentError(f"Q8_0 blocks need in_features divisible by {GROUP_SIZE}, got [{n}, {k}]")
    g = w.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    d = (g.abs().amax(-1) / 127).half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(g / safe.unsqueeze(-1)).clamp(-127, 127)
    return BlockQuantized("q8_0", q.to(torch.int8).view(n, k), d, None)


def q4_1_from_float(w: torch.Tensor) -> BlockQuantized:
    """A float weight [out, in] as GGUF Q4_1 blocks (what `quantize="int4"` becomes on forklm's block
    kernel): per block of 32 along `in`, d = (max − min) / 15 and m = min, both rounded to float16,
    then q = round((w − m) / d) in 0..15 against the rounded values (d = 0: a constant block, q = 0)."""
    _check_shape("int4", tuple(w.shape))
    n, k = w.shape
    g = w.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((g - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15)
    q = torch.where((d == 0).unsqueeze(-1), torch.zeros_like(q), q)
    return BlockQuantized("q4_1", q.to(torch.uint8).view(n, k), d, m)


def build_matrix(parts: list, how: str, backend: Backend):
    """Weights [out_i, in] (float tensors or GGUF blocks) fused along `out`, as the backend runs them:
    a QuantizedLinear where its quantized kernels run (the block kernel's `BlockLinear` where
    `backend.block_kernel`), else a dense [out, in] tensor in its dtype holding the quantized weights'
    values (for "gguf": the blocks' exact float values). With "gguf", float tensors of the file stay
    float (dense)."""
    dtype, device = backend.dtype, backend.device
    if any(isinstance(p, GGMLWeights) for p in parts):
        if how == "gguf" and backend.quantized_kernels:
            return stored_matrix(parts, backend.block_kernel, backend.interleaved_k_quants)
        parts = [p.dequantize() if isinstance(p, GGMLWeights) else p for p in parts]
    if all(isinstance(p, BlockQuantized) for p in parts):
        w = BlockQuantized.cat(parts) if len(parts) > 1 else parts[0]
    else:
        w = torch.cat([p.dequantize() if isinstance(p, BlockQuantized) else p.float() for p in parts], dim=0)
    if how == "gguf" and not isinstance(w, BlockQuantized):
        return w.to(device=device, dtype=dtype)
    if not backend.quantized_kernels:
        if how == "gguf":
            values = w.dequantize()
        else:
            values = quantize_weight(w, how, torch.float32, keep_dense=False).dequantize()
        return values.to(device=device, dtype=dtype)
    return quantize_weight(w, how, kernel_dtype(dtype), block_kernel=backend.block_kernel, dense_dtype=dtype)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The model's product: a QuantizedLinear, or a dense weight in the checkpoint layout [out, in]."""
    if isinstance(w, QuantizedLinear):
        return w(x, bias)
    return F.linear(x, w, bias)
