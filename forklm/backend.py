"""Where and how a model runs, decided once: the backend layer.

`Backend.resolve` turns what the user asked (dtype, device, quantize) and what this machine has (CPU
features, the native kernels built here) into one `Backend` per model, which the loader
(`keeps_gguf_blocks`), the model (weight formats, layouts, rows rules), the engine (decode attention
kernel, KV dtype) and the drafter (its own model's backend) receive. Every rule here is fixed by the
machine's features and the model's format, never a timing probe (a probe that chose differently from
one process to the next would make seeded samples differ between runs); the measurements behind each
rule are in docs/kernels.md and bench/results/. Where a model cannot take the fast path, the reason is
in `Backend.fallbacks` (shown once at load and by `forklm info`).

Adding a quantization type or a CPU feature touches this module and the kernels, nothing above them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from forklm.device import cpu_has_native_bf16, resolve_device, resolve_dtype
from forklm.errors import InvalidArgumentError

QUANTIZE_CHOICES = ("int8", "int4", "gguf", "auto")
DECODE_KERNELS = ("auto", "torch", "triton", "cpu")

# Rows per step at or below which PyTorch's int8 / int4 kernels run; above, the dense copy (bfloat16
# activations). The 49152-row LM head stays on the kernel longer: it is the one product bound by
# weight bytes well past a few rows.
KERNEL_MAX_ROWS = {"int4": 4, "int8": 4}
KERNEL_MAX_ROWS_WIDE = {"int4": 12, "int8": 4}  # out_features >= WIDE_OUT (the LM head)
# A float32 model (CPUs without native bfloat16): the kernels take its activations rounded to
# bfloat16 and the dense copy is float32, much slower per row than bfloat16 on skinny products.
KERNEL_MAX_ROWS_F32 = {"int4": 16, "int8": 16}
KERNEL_MAX_ROWS_F32_WIDE = {"int4": 64, "int8": 16}
WIDE_OUT = 16384
# forklm's block kernel with an opt-in dense copy (`BlockLinear(keep_dense=True)`; no file's default
# path keeps one): rows per step at or below which the kernel runs. Dense float32 copies: the kernel
# is faster at every count up to 96 rows (bench/results/block_kernel_crossover_avx2_builds.json).
# bfloat16 copies (CPUs with native bfloat16; bench/results/block_kernel_crossover_cpu_avx512.json):
# the layers' kernel wins up to 24 rows and loses from 32; the LM head's wins at 8 and loses from 16.
BLOCK_KERNEL_MAX_ROWS = 96
BLOCK_KERNEL_MAX_ROWS_WIDE = 96
BLOCK_KERNEL_MAX_ROWS_BF16 = 24
BLOCK_KERNEL_MAX_ROWS_BF16_WIDE = 8


def block_dense_dtype() -> torch.dtype:
    """The dtype of a `BlockLinear`'s opt-in dense copy: bfloat16 where the CPU multiplies it
    natively, else float32 (emulated bfloat16 products are 5-10x slower)."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def block_kernel_max_rows(out_features: int, dense_dtype: torch.dtype) -> int:
    """Rows per step at or below which a `BlockLinear` with a dense copy runs the block kernel."""
    wide = out_features >= WIDE_OUT
    if dense_dtype == torch.bfloat16:
        return BLOCK_KERNEL_MAX_ROWS_BF16_WIDE if wide else BLOCK_KERNEL_MAX_ROWS_BF16
    return BLOCK_KERNEL_MAX_ROWS_WIDE if wide else BLOCK_KERNEL_MAX_ROWS


def kernel_max_rows(kind: str, out_features: int, dense_dtype: torch.dtype) -> int:
    """Rows per step at or below which a product runs PyTorch's int8 / int4 kernel."""
    wide = out_features >= WIDE_OUT
    if dense_dtype == torch.float32:
        return (KERNEL_MAX_ROWS_F32_WIDE if wide else KERNEL_MAX_ROWS_F32)[kind]
    return (KERNEL_MAX_ROWS_WIDE if wide else KERNEL_MAX_ROWS)[kind]


def torch_quant_kernels_available() -> bool:
    """Whether this PyTorch has the int8 / int4 weight-only CPU kernels (2.6 or newer)."""
    ops = torch.ops.aten
    return all(hasattr(ops, name) for name in
               ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


def block_kernel_error() -> str | None:
    """None where forklm's block kernel runs (x86-64 with AVX2, FMA, F16C, built on first use), else why not."""
    from forklm.kernels import block_gemm

    return block_gemm.build_error()


def block_kernel_available() -> bool:
    return block_kernel_error() is None


def k_quants_interleaved() -> bool:
    """Whether GGUF Q4_K / Q5_K tensors take the block kernel's interleaved layouts (q4_k_r8 / q5_k_r8), else
    the plain ones (`tile_k`): wherever the block kernel runs. On its AVX512-VNNI build the two-group 512-bit
    tiles ran a 1B Q4_K_M file's Q4_K products 1.5x the plain layout's at 8-32 rows (2026-11-28, Cascade Lake
    Xeon); on the AVX2 build, since its 4-bit tile keeps its adds in order (`keep_order`), the same file's
    Q4_K products at 1 / 8 / 32 rows 1.12x / 1.10x / 1.08x the plain layout's and a Q5_K_M preset's Q5_K ones
    1.17x at 32 rows (2026-12-04, AVX2 EPYC, by hand; before that the plain layout was faster there).
    Q6_K is interleaved on both builds."""
    return block_kernel_available()


def quantized_kernels_run(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether quantized weights run as such (else they are dequantized at load): on CPU, for
    bfloat16 and float32 models alike."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation (and scale) dtype PyTorch's int8 / int4 kernels run in for a model of `dtype`."""
    return torch.bfloat16


def head_format(how: str | None) -> str | None:
    """The embedding / LM head's format under `how`: int8 per channel for "int4" too (with the
    head in int4 as well, SmolLM2-135M's perplexity rose 7.3% over float32; GGUF files make the same
    choice: this one stores its layers Q4_1 and token_embd Q8_0)."""
    return "int8" if how == "int4" else how


def weight_layout_for(dtype: torch.dtype, device: torch.device) -> str:
    """"in_out" (dense weights stored transposed, x @ W) or "out_in" (as in the checkpoint, F.linear):
    float32 on CPU transposed (10-20% faster on AVX-512 CPUs, the 49k-column LM head most), bfloat16
    and CUDA as in the checkpoint (bfloat16 transposed ran 9x slower on an AVX2 EPYC)."""
    if device.type == "cpu" and dtype == torch.float32:
        return "in_out"
    return "out_in"


def check_quantize(quantize) -> str | None:
    """The `quantize` argument, checked and lower-cased: None, "auto", "int8", "int4" or "gguf"."""
    if quantize is None or quantize is False:
        return None
    if not isinstance(quantize, str) or quantize.lower() not in QUANTIZE_CHOICES + ("none",):
        raise InvalidArgumentError(
            f"quantize must be None, 'none', 'auto', 'int8', 'int4' or 'gguf' (as stored in a GGUF file), got {quantize!r}"
        )
    q = quantize.lower()
    return None if q == "none" else q


def resolve_quantize(quantize: str | None, dtype: torch.dtype, device: torch.device,
                     has_gguf_blocks: bool | None = None, fallbacks: list[str] | None = None) -> str | None:
    """The quantization to apply: None, "int8", "int4" or "gguf" (GGUF blocks as stored).

    "auto": "gguf" on CPU when the file stores quantized blocks and forklm's block kernel runs here,
    else None. has_gguf_blocks None: not known yet (the caller loads the file with its blocks kept).
    fallbacks: where given, a fall-back "auto" takes is appended to it (the reason shown at load).
    """
    q = check_quantize(quantize)
    if q is None:
        return None
    if q == "auto":
        if not quantized_kernels_run(dtype, device) or not torch_quant_kernels_available():
            return None
        if has_gguf_blocks is not False and not block_kernel_available():
            if has_gguf_blocks and fallbacks is not None:
                fallbacks.append(f"GGUF blocks dequantized to float at load: forklm's block kernel does not run here "
                                 f"({block_kernel_error()})")
            return None
        return "gguf" if has_gguf_blocks is not False else None
    if device.type != "cpu":
        raise InvalidArgumentError(
            f"quantize={quantize!r} uses PyTorch's CPU kernels and is supported on device 'cpu' only, got {device}"
        )
    if not torch_quant_kernels_available():
        raise InvalidArgumentError(
            f"quantize={quantize!r} needs PyTorch's int8/int4 CPU kernels (PyTorch 2.6 or newer; tested with 2.13.0), "
            f"which this PyTorch {torch.__version__} lacks"
        )
    if q == "gguf" and has_gguf_blocks is False:
        raise InvalidArgumentError("quantize='gguf' keeps a GGUF file's quantized blocks: give a .gguf model")
    return q


def cpu_attention_error(dtype: torch.dtype, device: torch.device, head_dim: int) -> str | None:
    """None where forklm's C++ decode attention runs this model, else why not."""
    from forklm.kernels import cpu_attention

    if device.type != "cpu":
        return f"it runs on CPU, the model is on {device.type}"
    if cpu_attention.build_error() is not None:
        return cpu_attention.build_error()
    if not cpu_attention.supports(dtype, head_dim):
        return (f"it runs float32 and bfloat16 models with a head dim that is a multiple of 16; this one is {dtype}, "
                f"head dim {head_dim}")
    return None


@dataclass
class Backend:
    """One model's placement, resolved once (`Backend.resolve`; `Backend.exact` for given values)."""

    device: torch.device
    dtype: torch.dtype  # the model's activations and dense weights
    quantize: str | None = None  # None | "int8" | "int4" | "gguf" (GGUF blocks as stored)
    weight_layout: str = "out_in"  # dense weights: "in_out" (x @ W) | "out_in" (F.linear)
    quantized_kernels: bool = False  # quantized weights run as such (else dequantized at load)
    block_kernel: bool = False  # GGUF blocks and "int4" run on forklm's block kernel (float32 activations)
    interleaved_k_quants: bool = False  # GGUF Q4_K / Q5_K in q4_k_r8 / q5_k_r8 (`k_quants_interleaved`), else q4_k / q5_k
    decode_kernel: str | None = None  # decode attention under EngineConfig(decode_kernel="auto"); set by `for_model`
    fallbacks: list[str] = field(default_factory=list)  # each fall-back from the fast path, and why

    @classmethod
    def resolve(cls, *, dtype="auto", device="auto", quantize="auto", has_gguf_blocks: bool) -> Backend:
        """What the user asked (LLM's dtype / device / quantize arguments) and what this machine runs,
        for weights that do (not) hold GGUF quantized blocks."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        fallbacks: list[str] = []
        how = resolve_quantize(quantize, dt, dev, has_gguf_blocks=has_gguf_blocks, fallbacks=fallbacks)
        runs_blocks = how in ("int4", "int8") or (how == "gguf" and has_gguf_blocks)
        if (dtype is None or dtype == "auto") and dev.type == "cpu" and runs_blocks and block_kernel_available():
            # the block kernel's activations are float32 whatever the dtype, and a bfloat16 model would run
            # PyTorch's int4 kernel instead (1.6-1.9x slower a decode step at n <= 8 on AVX512-BF16; int8
            # follows the same rule, its Q8_0 blocks resident once where PyTorch's kernel keeps a dense copy)
            dt = torch.float32
        if how in ("int4", "int8") and dev.type == "cpu" and not block_kernel_available():
            fallbacks.append(f"quantize={how!r} runs PyTorch's {how} kernel with a dense copy: forklm's block kernel "
                             f"does not run here ({block_kernel_error()})")
        return cls.exact(dt, dev, how, fallbacks=fallbacks)

    @classmethod
    def exact(cls, dtype: torch.dtype, device: torch.device, quantize: str | None = None,
              weight_layout: str | None = None, *, fallbacks: list[str] | None = None) -> Backend:
        """A backend for these resolved values (tests and tools that build a model directly).
        weight_layout None: the rule (`weight_layout_for`); quantized kernels take "out_in"."""
        if weight_layout not in (None, "in_out", "out_in"):
            raise ValueError(f"weight_layout must be 'in_out', 'out_in' or None, got {weight_layout!r}")
        if quantize not in (None, "int8", "int4", "gguf"):
            raise ValueError(f"quantize must be None, 'int8', 'int4' or 'gguf', got {quantize!r}")
        fallbacks = list(fallbacks or [])
        quantized = quantize is not None and quantized_kernels_run(dtype, device)
        if quantized and weight_layout == "in_out":
            raise ValueError("quantized weights use the checkpoint layout 'out_in'")
        if quantize is not None and not quantized:
            fallbacks.append(f"quantize={quantize!r} weights dequantized to {dtype} at load: the quantized kernels run "
                             f"bfloat16 / float32 models on CPU")
        layout = weight_layout or ("out_in" if quantized else weight_layout_for(dtype, device))
        block = quantized and dtype == torch.float32 and device.type == "cpu" and block_kernel_available()
        return cls(device, dtype, quantize, layout, quantized, block, interleaved_k_quants=block and k_quants_interleaved(),
                   fallbacks=fallbacks)

    def for_model(self, head_dim: int) -> None:
        """Settles what depends on the model's shape (the model calls it once): the decode attention
        kernel, the C++ one where it runs this model."""
        if self.decode_kernel is not None:
            return
        self.decode_kernel = "torch"
        if self.device.type == "cpu":
            why = cpu_attention_error(self.dtype, self.device, head_dim)
            if why is None:
                self.decode_kernel = "cpu"
            else:
                self.fallbacks.append(f"decode attention runs PyTorch's products: the C++ attention kernel does not ({why})")

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether the loader keeps a GGUF file's quantized blocks (else it dequantizes them)."""
        return self.quantize == "gguf"

    def engine_decode_kernel(self, choice: str) -> str:
        """The decode attention kernel for `EngineConfig.decode_kernel`: "auto" is this backend's rule (the
        C++ kernel where it runs; the Triton kernel is checked in its interpreter and becomes the CUDA
        default once timed on a GPU); a kernel that cannot run this model is an error naming why."""
        if choice not in DECODE_KERNELS:
            raise InvalidArgumentError(f"decode_kernel must be one of {DECODE_KERNELS}, got {choice!r}")
        if choice == "auto":
            return self.decode_kernel
        if choice == "cpu" and self.decode_kernel != "cpu":
            why = next((f for f in self.fallbacks if f.startswith("decode attention")), "")
            raise InvalidArgumentError(f"decode_kernel='cpu' needs a float32 or bfloat16 CPU model with head dim a multiple of 16 "
                                       f"on an AVX2 CPU ({why or 'not resolved for this model'})")
        if choice == "triton":
            from forklm.kernels.segment_attention import available

            if not available():
                raise InvalidArgumentError("decode_kernel='triton' needs the triton package (pip install triton)")
        return choice

    def kv_dtype(self, choice: str, decode_kernel: str) -> torch.dtype:
        """The KV cache's dtype for `EngineConfig.kv_dtype`: "model" (the model's), "float16" (halves the
        cache; the C++ decode kernel only), "auto": float16 on the C++ kernel for quantized models, else
        the model's."""
        if choice not in ("auto", "model", "float16"):
            raise InvalidArgumentError(f"kv_dtype must be 'auto', 'model' or 'float16', got {choice!r}")
        if choice == "model" or (choice == "auto" and (decode_kernel != "cpu" or self.quantize is None)):
            return self.dtype
        if decode_kernel != "cpu":
            raise InvalidArgumentError(f"kv_dtype='float16' needs the 'cpu' decode kernel (this engine runs {decode_kernel!r})")
        return torch.float16

    def rows_limit(self, kind: str, out_features: int) -> int:
        """Rows per step at or below which a quantized product of this kind runs its kernel."""
        if kind in ("int8", "int4"):
            return kernel_max_rows(kind, out_features, self.dtype)
        return sys.maxsize

    def describe(self) -> str:
        q = f", quantize={self.quantize!r}" if self.quantize else ""
        return (f"{str(self.dtype).replace('torch.', '')} on {self.device}{q}, dense weights {self.weight_layout}, "
                f"decode attention {self.decode_kernel}" + (", block kernel" if self.block_kernel else ""))


def keeps_half_matrices(dtype="auto", device="auto", quantize="auto") -> bool:
    """Whether a Hugging Face folder's bfloat16 / float16 matrices stay as stored (16 bits a value, on
    the block kernel's bf16 / f16 tiles: float32 products with float32 activations, the decode stack,
    each row's result its own), as a GGUF file's BF16 / F16 tensors do: under quantize "auto" / "gguf",
    dtype "auto" / float32 (a model asked for in bfloat16 stays PyTorch's), on a CPU where the block
    kernel runs. Else the folder loads dense in the model dtype."""
    from forklm.device import resolve_device

    q = check_quantize(quantize)
    if q not in ("auto", "gguf") or resolve_device(device).type != "cpu" or not block_kernel_available():
        return False
    return dtype is None or dtype == "auto" or dtype == torch.float32 or dtype == "float32"


def loader_keeps_gguf_blocks(quantize="auto") -> bool:
    """Whether a GGUF file is read with its quantized blocks kept, before its tensors are known: for
    any `quantize` but None, so that `Backend.resolve` sees them and decides (blocks that end up
    dequantized give the float loader's values exactly)."""
    return check_quantize(quantize) is not None
