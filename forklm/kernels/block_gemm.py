"""GGUF weight blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS layouts) times float32
activations on x86 CPUs with AVX2: integer dot products over activations quantized per row and block
of 32 (K-quants: per super-block of 256, the sub-block scales applied in integers) (csrc/block_gemm.cpp, built on first use by `kernels/native.py` into forklm's cache; on CPUs with
AVX512-VNNI a variant built with it, equal bit for bit: `uses_vnni`).

Why our own kernel: PyTorch ships no Q4 x Q8 integer product for x86 (its int4 CPU kernel takes
bfloat16 activations and is compute-bound on AVX2), torchao's PyPI wheel has CUDA kernels only, and
fbgemm's dynamic int8 linear scales all rows of a step together (a sample's logits would depend on
its batch). Rows here are quantized one by one, so each row's result depends on that row alone.

    w = pack_q4_1(q, d, m)   # BlockWeights: the GGUF blocks' values and float16 scales
    y = gemm(x, w)           # x float32 [T, K] -> y float32 [T, N]

`gemm_reference` is the slow, obvious version the tests hold the kernel to. FORKLM_BLOCK_KERNEL=0 in
the environment turns the kernel off (GGUF blocks then run on PyTorch's int4 kernel, as without AVX2).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from forklm.device import cpu_flags

BLOCK = 32
# IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl): w = d·IQ4_NL_LEVELS[q]
IQ4_NL_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)
SUPER_BLOCK = 256  # a K-quant super-block (K-quant weights take activations quantized per 256)
SUPER_BLOCK_KINDS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs")  # the layouts whose activations are per 256
_SOURCE = Path(__file__).parent / "csrc" / "block_gemm.cpp"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_supports() -> bool:
    """Whether this CPU runs the kernel (x86-64 with AVX2, FMA and F16C): a fixed rule of its features."""
    return platform.machine() in ("x86_64", "AMD64") and all(f in cpu_flags() for f in REQUIRED_CPU_FLAGS)


OPENMP_PREFIXES = ("libgomp", "libiomp", "libomp")


@lru_cache(maxsize=1)
def openmp_runtime() -> str | None:
    """The file name of the OpenMP runtime torch runs on, read from the libraries this process has
    loaded: the one in torch's own lib folder (libgomp.so.1 in today's x86 wheels, a renamed copy
    such as libgomp-<hash>.so.1 in older ones), else a system runtime torch links; None if none.
    (Other wheels load their own renamed copies, e.g. sentencepiece's: not torch's, not counted.)
    Read once per process: torch's runtime is loaded with torch."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    loaded = [Path(p) for p in paths if Path(p).name.startswith(OPENMP_PREFIXES)]
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    own = [p for p in loaded if p.parent == torch_lib]
    system = [p for p in loaded if ".libs" not in p.parent.name and "site-packages" not in str(p)]
    found = own or system
    return found[0].name if found else None


def _torch_uses_libgomp() -> bool:
    """The kernels' threads are OpenMP's: they link libgomp.so.1, which resolves to the runtime torch
    loaded only where that is GNU OpenMP under its own name; a renamed copy or another runtime would
    give a second thread pool, so the kernels are not built then (the reason says which runtime)."""
    return openmp_runtime() == "libgomp.so.1"


def load_cpu_extension(name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
    """Builds (once per machine and version, `native.load_extension`) and loads one of forklm's AVX2
    C++ sources as a Python module (`extra_cflags`: a variant's further instruction sets; a variant
    needs its own `name`)."""
    from forklm.kernels import native

    # -fopenmp: at::parallel_for is inline OpenMP; the process already holds torch's libgomp.so.1,
    # which the extension's libgomp.so.1 dependency resolves to (one thread pool)
    return native.load_extension(
        name, source, ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", *extra_cflags],
        ["-fopenmp"])


def cpu_extension_error(load, kernel: str = "C++") -> str | None:
    """None when `load()` builds and loads an extension on this machine, else why not (a build that
    fails on a CPU that should run it is said once, as a warning naming the kernel)."""
    from forklm.kernels import native

    if not cpu_supports():
        return f"this CPU lacks one of {', '.join(REQUIRED_CPU_FLAGS)} (or is not x86-64)"
    if not _torch_uses_libgomp():
        runtime = openmp_runtime()
        why = f"this torch runs on {runtime}, not GNU OpenMP's libgomp.so.1, which the kernels' threads share"
        native.warn_once(kernel, why, "PyTorch's operators run instead")
        return why
    try:
        load()
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the caller falls back
        text = str(e).strip()
        why = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
        native.warn_once(kernel, why, "PyTorch's operators run instead")
        return why
    return None


# AVX512-VNNI (with AVX512-VL for its 256-bit form) sums 4 byte products into an int32 lane in one
# instruction where AVX2 takes two (maddubs + madd): the same integers, so both builds' products are
# equal bit for bit; the variant is picked by this fixed rule of the CPU's features.
# FORKLM_BLOCK_KERNEL_VNNI=0 keeps the AVX2 build on such a CPU (to compare the two).
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_VNNI_CFLAGS = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mprefer-vector-width=256")


def uses_vnni() -> bool:
    """Whether the kernel is built with AVX512-VNNI on this CPU (a fixed rule of its features)."""
    return (os.environ.get("FORKLM_BLOCK_KERNEL_VNNI", "1") != "0"
            and all(f in cpu_flags() for f in VNNI_CPU_FLAGS))


LOADED_BUILDS: dict[str, str] = {}  # name -> the build that loaded ("AVX512-VNNI" or "AVX2")

# AMX-INT8 (Intel Sapphire Rapids and later): the VNNI build runs the interleaved layouts' products of
# `AMX_MIN_ROWS` to `AMX_MAX_ROWS` rows (16-32: where they measured faster; but Q6_K's) on the tile unit, the same integers and float chains as its
# vector tiles, so the same bits (csrc/block_gemm.cpp, "AMX tiles"). FORKLM_BLOCK_KERNEL_AMX=0 turns them off.
AMX_CPU_FLAGS = ("amx_tile", "amx_int8")


def cpu_has_amx() -> bool:
    return all(f in cpu_flags() for f in AMX_CPU_FLAGS)


def uses_amx() -> bool:
    """Whether the block kernel runs products on AMX tiles here: its VNNI build loaded, the CPU has
    AMX-INT8, Linux lets the process use the tile data, and FORKLM_BLOCK_KERNEL_AMX is not 0."""
    if not available() or LOADED_BUILDS.get("forklm_block_gemm") != "AVX512-VNNI":
        return False
    return bool(_extension().amx_enabled())


def uses_amx_bf16() -> bool:
    """Whether bfloat16 products (K a multiple of 32) run on AMX-BF16 tiles here, at every row count:
    the VNNI build loaded, the CPU has AMX-BF16 and Linux's leave, FORKLM_BLOCK_KERNEL_AMX is not 0.
    Each float32 activation is split exactly into three bfloat16 parts, so the products stay float32-class
    (other last bits than the vector chains'; csrc/block_gemm.cpp, "AMX-BF16 tiles")."""
    if not available() or LOADED_BUILDS.get("forklm_block_gemm") != "AVX512-VNNI":
        return False
    return bool(_extension().amx_bf16_enabled())


def load_block_kernel_build(name: str, source: Path):
    """A source holding the block kernel, built as `name_vnni` with AVX512-VNNI where `uses_vnni`
    (falling back to the AVX2 build `name` if that build fails: said once, and recorded so that no
    later process retries it), else as `name`. `LOADED_BUILDS[name]` says which one runs."""
    from forklm.kernels import native

    if uses_vnni():
        try:
            module = load_cpu_extension(f"{name}_vnni", source, _VNNI_CFLAGS)
            LOADED_BUILDS[name] = "AVX512-VNNI"
            return module
        except Exception as e:  # noqa: BLE001 - a compiler without AVX512-VNNI: the AVX2 build still runs
            native.warn_once(f"{name} AVX512-VNNI", str(e).strip().splitlines()[-1] if str(e).strip() else repr(e),
                             "its AVX2 build runs instead")
    module = load_cpu_extension(name, source)
    LOADED_BUILDS[name] = "AVX2"
    return module


@lru_cache(maxsize=1)
def _extension():
    return load_block_kernel_build("forklm_block_gemm", _SOURCE)


@lru_cache(maxsize=1)
def build_error() -> str | None:
    """None when the kernel is built and loaded (building it on first call), else why not."""
    if os.environ.get("FORKLM_BLOCK_KERNEL", "1") == "0":
        return "disabled by FORKLM_BLOCK_KERNEL=0"
    return cpu_extension_error(_extension, "block")


def available() -> bool:
    return build_error() is None


# ----------------------------------------------------------------------------- block layouts
@dataclass
class BlockWeights:
    """A weight [N, K] as the kernel reads it: the GGUF blocks' values and float16 scales in
    separate arrays (so 8 blocks' scales load at once).

    q4_1: qs uint8 [N, K/2] (per block of 32: value j in the low nibble of byte j, value j + 16 in
          its high nibble, as GGUF stores it), d float16 [N, K/32] and m float16 [⌈N/8⌉, K/32, 8]
          (groups of 8 outputs, block by block, their minima side by side, the last group padded with
          zeros: the kernel sums Σ_b m·sx for 8 outputs at once): w = d·q + m.
    q4_1_r8: q4_1's blocks with 8 outputs interleaved (`interleave_r8`), the layout GGUF Q4_0 / Q4_1
          tensors and `quantize="int4"` run on: qs uint8 [⌈N/8⌉, K/32, 128] (per group of 8 outputs
          and block, 4 runs of 32 bytes, run j = bytes 4j..4j+3 of each output's 16 GGUF bytes, output r
          at 4r), d float16 [⌈N/8⌉, K/32, 8], m float16 [⌈N/8⌉, K/32, 8] (q4_1's grouped minima, the
          last group padded with zeros), count int64 [1] holding N: w = d·q + m.
    q4_0_r8: q4_1_r8 without minima (GGUF Q4_0): w = d·(q − 8).
    iq4_nl_r8: q4_0_r8's arrays, the nibbles IQ4_NL level indices (GGUF IQ4_NL): w = d·IQ4_NL_LEVELS[q].
    q8_0_r8: q8_0's blocks with 8 outputs interleaved, the layout GGUF Q8_0 tensors and `quantize="int8"`
          run on: qs int8 [⌈N/8⌉, K/32, 256] (per group and block 8 runs of 32 bytes, run j = values
          4j..4j+3 of each output, output r at 4r), d float16 [⌈N/8⌉, K/32, 8], count: w = d·q.
    q5_1_r8 / q5_0_r8: q4_1_r8 / q4_0_r8 (the values' low 4 bits) and qh uint8 [⌈N/8⌉, K/32, 32], the fifth
          bits (byte 4r + k of a block: at bit j that of value 4j + k of output r, at bit 4 + j that of
          value 16 + 4j + k): w = d·q + m / d·(q − 16), q in 0..31 (GGUF Q5_1 / Q5_0).
    q5_1: q4_1's arrays (the values' low 4 bits) and qh int32 [N, K/32]: their fifth bits, a block
          pair's two words arranged as the kernel reads the pair (`arrange_high_bits`): w = d·q + m,
          q in 0..31 (GGUF Q5_0 is Q5_1 with minimum −16d, exactly).
    q4_k: q4_1's values with GGUF K-quants' scales (K a multiple of 256): d float16 [N, K/256] (the
          super-block scales ds), sc uint8 [N, K/32] (6-bit block scales), m uint8 [⌈N/8⌉, K/32, 8]
          (6-bit block minima, grouped as q4_1's m) and dm float16 [⌈N/8⌉, K/256, 8] (the super-blocks'
          −dmin, grouped the same way): w = ds·sc·q + dm·mq, each product exact in float32.
    q5_k: q4_k's arrays and q5_1's qh.
    q4_k_r8 / q5_k_r8: q4_k / q5_k with 8 outputs interleaved, the layout GGUF Q4_K / Q5_K tensors run on:
          q4_1_r8's qs (and q5_1_r8's qh), d float16 [⌈N/8⌉, K/256, 8] (ds), sc and m uint8 [⌈N/8⌉, K/32, 8]
          (the blocks' 6-bit scales and minima mq), dm float16 [⌈N/8⌉, K/256, 8] (−dmin), count:
          w = (ds·sc)·q + dm·mq, each product exact in float32; run as q4_1_r8 / q5_1_r8 with those
          scales and minima (activations per block of 32 on the VNNI build, per 256 on the AVX2 one:
          `activation_block`).
    q6_k_r8: q6_k with 8 outputs interleaved, the layout GGUF Q6_K tensors run on: qs as q4_1_r8's (the
          values' low 4 bits), q2 uint8 [⌈N/8⌉, K/32, 64] (their bits 4-5: byte 4r + k of a block's first 32
          holds at bits 2j..2j+1 those of value 4j + k of output r, of the next 32 those of value 16 + 4j + k),
          d float16 [⌈N/8⌉, K/256, 8] (ds), sc int8 [⌈N/8⌉, K/32, 16] (a block's first 16 values' scale for
          the 8 outputs, then its second 16's), count: w = (ds·sc)·(q − 32), activations as q4_k_r8's.
    q6_k: GGUF Q6_K (K a multiple of 256): qs as q4_1's (the values' low 4 bits), q2 uint8 [N, K/4]
          (bits 4-5: per pair of blocks of 32, 16 bytes, byte k holding those of value k of the first
          and of the second block at bits 0-1 and 2-3, of value 16 + k of each at bits 4-5 and 6-7),
          d float16 [N, K/256] (ds) and sc int8 [N, K/16] (a scale per 16 values), m None:
          w = ds·sc·(q − 32).
    q3_k: GGUF Q3_K (K a multiple of 256): qs uint8 [N, K/4] the values' bits 0-1 as the file stores
          them (per super-block 64 bytes: value 128h + 32j + l at bits 2j of byte 32h + l), q2 uint8
          [N, K/8] their bit 2 as the file's masks (per super-block 32 bytes: that value's at bit
          4h + j of byte l), d float16 [N, K/256] (ds), sc int8 [N, K/16] (the file's 6-bit scales − 32),
          m None: w = ds·sc·(q − 4), q in 0..7.
    q2_k: GGUF Q2_K (K a multiple of 256): qs uint8 [N, K/4] the values (0..3, as q3_k's qs),
          d float16 [N, K/128] (per super-block ds then dmin), sc uint8 [N, K/16] (per 16 values the
          file's byte: scale in bits 0-3, minimum in bits 4-7), m None: w = ds·sc·q − dmin·mn.
    q8_0: qs int8 [N, K], d float16 [N, K/32], m None: w = d·q.
    iq4_nl: GGUF IQ4_NL: qs uint8 [N, K/2] level indices as q4_1's nibbles, d float16 [N, K/32], m None:
          w = d·IQ4_NL_LEVELS[q] (run as q8_0 on the looked-up int8 levels).
    iq4_xs: GGUF IQ4_XS (K a multiple of 256): qs as iq4_nl's (the file's own order), d float16
          [N, K/256] (ds), sc int8 [N, K/32] (the file's 6-bit scales − 32), m None:
          w = ds·sc·IQ4_NL_LEVELS[q] (run as the K-quants, in integers per super-block).
    bf16 / f16: float weights as stored, qs bfloat16 / float16 [N, K] (GGUF BF16 / F16 tensors, often the
          mapped file itself), d empty, m None: w = qs, multiplied in float32 with float32 activations
          (`pack_half`; no activation quantization). Gathered from parts (`gather_half`: a fused q/k/v
          where the file maps each, rows in any order): qs int64 [N] the rows' addresses, sources the
          parts (each matrix [n_p, K] and its rows' order or None), held while the weights are.
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    n: int
    k: int
    qh: torch.Tensor | None = None  # q5_1 / q5_k only
    sc: torch.Tensor | None = None  # q4_k / q5_k / q6_k / q3_k / q2_k / iq4_xs only
    dm: torch.Tensor | None = None  # q4_k / q5_k only
    q2: torch.Tensor | None = None  # q6_k / q3_k only
    count: torch.Tensor | None = None  # the interleaved layouts (R8_KINDS) only: int64 [1] holding N
    sources: tuple | None = None  # bf16 / f16 gathered from parts only: ((matrix [n_p, K], order int64 [n_p] | None), ..)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        held = [t for src in self.sources or () for t in src if t is not None]
        return held + [t for t in (self.qs, self.d, self.m, self.qh, self.sc, self.dm, self.q2, self.count) if t is not None]

    def values(self) -> torch.Tensor:
        """bf16 / f16 weights [N, K] (gathered from their parts: a copy, for the slow paths; the kernel reads
        the parts where they are)."""
        if self.sources is None:
            return self.qs
        return torch.cat([w if order is None else w.index_select(0, order) for w, order in self.sources])

    def kernel_arrays(self) -> tuple[torch.Tensor, ...]:
        """The arrays in the order the kernel's `gemm_<kind>` takes them."""
        if self.kind in HALF_KINDS:
            return (self.qs,)
        return {"q4_1": (self.qs, self.d, self.m), "q4_0_r8": (self.qs, self.d, self.count),
                "q8_0_r8": (self.qs, self.d, self.count), "iq4_nl_r8": (self.qs, self.d, self.count),
                "q4_1_r8": (self.qs, self.d, self.m, self.count), "q5_0_r8": (self.qs, self.qh, self.d, self.count),
                "q5_1_r8": (self.qs, self.qh, self.d, self.m, self.count), "q5_1": (self.qs, self.qh, self.d, self.m),
                "q4_k_r8": (self.qs, self.d, self.sc, self.m, self.dm, self.count),
                "q5_k_r8": (self.qs, self.qh, self.d, self.sc, self.m, self.dm, self.count),
                "q6_k_r8": (self.qs, self.q2, self.d, self.sc, self.count),
                "q4_k": (self.qs, self.d, self.sc, self.m, self.dm),
                "q5_k": (self.qs, self.qh, self.d, self.sc, self.m, self.dm),
                "q6_k": (self.qs, self.q2, self.d, self.sc), "q3_k": (self.qs, self.q2, self.d, self.sc),
                "q2_k": (self.qs, self.d, self.sc), "q8_0": (self.qs, self.d),
                "iq4_nl": (self.qs, self.d),
                "iq4_xs": (self.qs, self.d, self.sc)}[self.kind]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, K] uint8 0..15 / 0..31 or int8, d float32 [N, K/32] (q6_k / q3_k / q2_k: [N, K/16], a
        scale per 16 values), m float32 (the same groups) or None)."""
        if self.kind == "q8_0":
            return self.qs, self.d.float(), None
        if self.kind in R8_KINDS:
            return self._unpack_r8(deinterleave_r8(self))
        if self.kind in ("q3_k", "q2_k"):
            q = unpack_k_fields(self.qs, self.n, self.k)
            if self.kind == "q3_k":
                q = (q | (unpack_k_masks(self.q2, self.n, self.k) << 2)).to(torch.int8) - 4
                return q, self.d.float().repeat_interleave(16, dim=1) * self.sc.float(), None
            dd = self.d.float().view(self.n, -1, 2).repeat_interleave(16, dim=1)  # [N, K/16, (ds, dmin)]
            sc = self.sc.long()
            return q, dd[..., 0] * (sc & 15).float(), -(dd[..., 1] * (sc >> 4).float())
        nib = self.qs.view(self.n, self.k // BLOCK, 16)
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).reshape(self.n, self.k)
        if self.kind == "iq4_nl":  # level indices
            return IQ4_NL_LEVELS[q.long()], self.d.float(), None
        if self.kind == "iq4_xs":
            return IQ4_NL_LEVELS[q.long()], self.d.float().repeat_interleave(8, dim=1) * self.sc.float(), None
        if self.kind == "q6_k":
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(2, 2, 1)  # [half, block of the pair]
            high = (self.q2.view(self.n, self.k // (2 * BLOCK), 1, 1, 16) >> shifts) & 3  # [N, pair, half, block, k]
            q = (q | (high.transpose(2, 3).reshape(self.n, self.k) << 4)).to(torch.int8) - 32
            return q, self.d.float().repeat_interleave(16, dim=1) * self.sc.float(), None
        if self.qh is not None:
            bits = arrange_high_bits(self.qh).long() & 0xFFFFFFFF  # [N, nb]: bit j = value j's fifth bit
            fifth = (bits.unsqueeze(-1) >> torch.arange(BLOCK)) & 1  # [N, nb, 32]
            q = q | (fifth.reshape(self.n, self.k) << 4).to(torch.uint8)
        if self.sc is None:
            return q, self.d.float(), unblock_minima(self.m, self.n).float()
        d = self.d.float().repeat_interleave(8, dim=1) * self.sc.float()
        m = unblock_minima(self.dm, self.n).float().repeat_interleave(8, dim=1) * unblock_minima(self.m, self.n).float()
        return q, d, m

    def _unpack_r8(self, plain: BlockWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`unpack` of this interleaved layout's rows laid out plain (`deinterleave_r8`): Q4_0 / Q5_0's
        minima −8d / −16d formed in float32, not taken from the plain layout's float16."""
        q, d, m = plain.unpack()
        return q, d, {"q4_0_r8": -8 * d, "q5_0_r8": -16 * d}.get(self.kind, m)

    def _check_rows(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"weight rows {ids.min().item()}..{ids.max().item()} asked of {self.n}")

    def rows(self, ids: torch.Tensor) -> BlockWeights:
        """The weight rows `ids` (int64 [R]) as blocks of their own (IndexError for an id outside 0..N-1)."""
        self._check_rows(ids)
        if self.kind in HALF_KINDS:
            return BlockWeights(self.kind, self.values().index_select(0, ids), self.d, None, int(ids.numel()), self.k)
        if self.kind in R8_KINDS:  # only their lanes are read (an embedding lookup)
            return interleave_r8(deinterleave_r8(self, ids), minima=self.m is not None)
        pick = lambda t: None if t is None else t.index_select(0, ids)
        regroup = lambda t: None if t is None else block_minima(unblock_minima(t, self.n).index_select(0, ids))
        return BlockWeights(self.kind, pick(self.qs), pick(self.d), regroup(self.m), int(ids.numel()), self.k,
                            pick(self.qh), pick(self.sc), regroup(self.dm), pick(self.q2))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: d·q (+ m) per block of the unpacked values (bf16 / f16: the values widened)."""
        if self.kind in HALF_KINDS:
            return self.values().float()
        return dequantize_values(*self.unpack())

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [R, K]: `rows(ids).dequantize()` (an embedding lookup; interleaved layouts read the rows
        from their lanes without laying them out interleaved again)."""
        if self.kind in HALF_KINDS:
            self._check_rows(ids)
            return self.values().index_select(0, ids).float()
        if self.kind not in R8_KINDS:
            return self.rows(ids).dequantize()
        if available():  # the same values in one C++ call (tested equal to the tensor operations below)
            if self.kind == "q6_k_r8":  # its bits 4-5 in qh's place, ds in d's, the scales per 16
                return _extension().dequantize_rows_r8(R8_KINDS.index(self.kind), self.qs, self.q2, self.d, None,
                                                       self.n, ids, self.sc, None)
            if self.sc is not None:  # K layouts: d, m are ds, dm per super-block; sc, mq per block
                return _extension().dequantize_rows_r8(R8_KINDS.index(self.kind), self.qs, self.qh, self.d, self.dm,
                                                       self.n, ids, self.sc, self.m)
            return _extension().dequantize_rows_r8(R8_KINDS.index(self.kind), self.qs, self.qh, self.d, self.m,
                                                   self.n, ids)
        self._check_rows(ids)
        return dequantize_values(*self._unpack_r8(deinterleave_r8(self, ids)))


def dequantize_values(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """float32 [N, K] from values q [N, K] and per-block scales d (minima m) [N, K / block] (block 32;
    Q6_K / Q3_K / Q2_K: 16), computed as gguf's numpy dequantization does ((d·q) + m in float32)."""
    n, k = q.shape
    w = q.float().view(n, d.shape[1], -1) * d.unsqueeze(-1)
    if m is not None:
        w = w + m.unsqueeze(-1)
    return w.view(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (their low 4 bits) -> [N, K/2] in Q4_1's order: per block of 32, value j in the
    low nibble of byte j, value j + 16 in its high nibble."""
    n, k = q.shape
    qb = q.to(torch.uint8).view(n, k // BLOCK, BLOCK) & 0x0F
    return (qb[..., :16] | (qb[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def fifth_bit_words(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in 0..31 -> int32 [N, K/32]: per block, bit j = value j's fifth bit, in the
    kernel's arrangement (`arrange_high_bits`)."""
    import numpy as np

    n, k = q.shape
    bits = ((q.to(torch.uint8) >> 4) & 1).view(n, k // BLOCK, BLOCK).numpy()
    words = np.packbits(bits, axis=-1, bitorder="little").view("<u4").view(np.int32).reshape(n, k // BLOCK)
    return arrange_high_bits(torch.from_numpy(words))


def two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values in 0..63 (K even in blocks of 32) -> uint8 [N, K/4]: their bits 4-5, per pair
    of blocks 16 bytes, byte k holding those of value k of the first and of the second block at bits
    0-1 and 2-3, of value 16 + k of each at bits 4-5 and 6-7 (q6_k's q2)."""
    n, k = q.shape
    high = (q.to(torch.uint8) >> 4).view(n, k // (2 * BLOCK), 2, 2, 16)  # [.., block of the pair, half, k]
    return (high[:, :, 0, 0] | (high[:, :, 1, 0] << 2) | (high[:, :, 0, 1] << 4) | (high[:, :, 1, 1] << 6)).reshape(n, k // 4)


def unpack_k_fields(fields: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q2_K / Q3_K's 2-bit fields as the file stores them (uint8 [N, K/4]: per super-block 64 bytes,
    value 128h + 32j + l at bits 2j of byte 32h + l) -> values uint8 [N, K] in 0..3."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return ((fields.view(n, k // SUPER_BLOCK, 2, 1, 32) >> shifts) & 3).reshape(n, k)


def pack_k_fields(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_k_fields`: uint8 [N, K] in 0..3 -> [N, K/4]."""
    n, k = q.shape
    v = q.to(torch.uint8).view(n, k // SUPER_BLOCK, 2, 4, 32)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 2) | (v[:, :, :, 2] << 4) | (v[:, :, :, 3] << 6)).reshape(n, k // 4)


def unpack_k_masks(masks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q3_K's third-bit masks as the file stores them (uint8 [N, K/8]: per super-block 32 bytes, value
    32b + l's bit at bit b of byte l) -> bits uint8 [N, K] in 0..1."""
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    return ((masks.view(n, k // SUPER_BLOCK, 1, 32) >> shifts) & 1).reshape(n, k)


def pack_k_masks(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_k_masks`: uint8 [N, K] of 0 / 1 -> [N, K/8]."""
    n, k = bits.shape
    v = bits.to(torch.uint8).view(n, k // SUPER_BLOCK, 8, 32)
    out = torch.zeros(n, k // SUPER_BLOCK, 32, dtype=torch.uint8)
    for b in range(8):
        out |= v[:, :, b] << b
    return out.reshape(n, k // 8)


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] in 0..15, d and m [N, K/32] holding float16 values."""
    n, k = q.shape
    _check_k(k)
    return BlockWeights("q4_1", pack_nibbles(q), _exact_half(d, "d"), block_minima(_exact_half(m, "m")), n, k)


HALF_KINDS = ("bf16", "f16")  # float weights as stored, 16 bits a value
HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def pack_half(w: torch.Tensor) -> BlockWeights:
    """A bfloat16 / float16 matrix [N, K] (K a multiple of 32) as the kernel's bf16 / f16 weights, kept
    as it is (no copy where it is contiguous)."""
    kind = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(w.dtype)
    if kind is None or w.dim() != 2:
        raise ValueError(f"bf16 / f16 weights are a bfloat16 or float16 matrix, got {w.dtype} {tuple(w.shape)}")
    _check_k(w.shape[1])
    return BlockWeights(kind, w.contiguous(), torch.empty(0, dtype=torch.float16), None, w.shape[0], w.shape[1])


def gather_half(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> BlockWeights:
    """bf16 / f16 weights whose rows are the parts' (each a contiguous bfloat16 / float16 matrix [n_p, K]
    and the order of its rows, int64 [n_p], or None: as they lie) one after the other, read where
    they are (a table of the rows' addresses, no copy: a fused q/k/v on the mapped file)."""
    if not parts:
        raise ValueError("no parts to gather")
    w0 = parts[0][0]
    kind = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(w0.dtype)
    k = w0.shape[-1] if w0.dim() == 2 else -1
    if kind is None or any(w.dtype != w0.dtype or w.dim() != 2 or w.shape[1] != k or not w.is_contiguous()
                           or w.device.type != "cpu" for w, _ in parts):
        raise ValueError("gathered bf16 / f16 parts are contiguous CPU matrices of one dtype and width, got "
                         + ", ".join(f"{w.dtype} {tuple(w.shape)}" for w, _ in parts))
    _check_k(k)
    table, sources = [], []
    for w, order in parts:
        n = w.shape[0]
        rows = torch.arange(n, dtype=torch.int64) if order is None else order.to(torch.int64)
        if rows.shape != (n,) or (n and (int(rows.min()) < 0 or int(rows.max()) >= n)):
            raise ValueError(f"a part's row order must be {n} rows of 0..{n - 1}")
        table.append(w.data_ptr() + rows * (k * w.element_size()))
        sources.append((w, None if order is None else rows))
    n = sum(w.shape[0] for w, _ in parts)
    return BlockWeights(kind, torch.cat(table), torch.empty(0, dtype=torch.float16), None, n, k,
                        sources=tuple(sources))


# blocks with 8 outputs interleaved, in the order of the C++ kernel's `R8Layout`
R8_KINDS = ("q4_0_r8", "q4_1_r8", "q5_0_r8", "q5_1_r8", "q8_0_r8", "iq4_nl_r8", "q4_k_r8", "q5_k_r8", "q6_k_r8")


def _fifth_bit_bytes(qh: torch.Tensor) -> torch.Tensor:
    """q5_1's arranged fifth-bit words int32 [N, nb] -> q5_1_r8's qh uint8 [⌈N/8⌉, nb, 32]."""
    n, nb = qh.shape
    bits = (arrange_high_bits(qh).long().unsqueeze(-1) >> torch.arange(BLOCK)) & 1  # [N, nb, 32]: GGUF's order
    lo, hi = bits[..., :16].view(n, nb, 4, 4), bits[..., 16:].view(n, nb, 4, 4)  # [.., j, k]: value 4j + k
    shifts = torch.arange(4).view(4, 1)
    byte = ((lo << shifts) | (hi << (shifts + 4))).sum(-2)  # [N, nb, k]
    padded = torch.zeros((n + 7) // 8 * 8, nb, 4, dtype=torch.uint8)
    padded[:n] = byte.to(torch.uint8)
    return padded.view(-1, 8, nb, 4).permute(0, 2, 1, 3).reshape(-1, nb, 32).contiguous()


def _fifth_bit_words(byte: torch.Tensor) -> torch.Tensor:
    """The inverse of `_fifth_bit_bytes`, per output: its bytes uint8 [N, nb, 4] (byte k of a block: bit j
    value 4j + k's fifth bit, bit 4 + j value 16 + 4j + k's) -> arranged int32 words [N, nb]."""
    n, nb, _ = byte.shape
    byte = byte.long()
    bits = (byte.unsqueeze(-1) >> torch.arange(8)) & 1  # [N, nb, k, p]
    lo, hi = bits[..., :4].transpose(-1, -2), bits[..., 4:].transpose(-1, -2)  # [N, nb, j, k]
    raw = torch.cat([lo.reshape(n, nb, 16), hi.reshape(n, nb, 16)], -1)  # value 4j + k, then 16 + 4j + k
    return arrange_high_bits(_as_int32((raw << torch.arange(BLOCK)).sum(-1)))


def interleave_r8(w: BlockWeights, minima: bool = True) -> BlockWeights:
    """q4_1 / q5_1 blocks -> q4_1_r8 / q5_1_r8 (minima=False: q4_0_r8 / q5_0_r8, for blocks whose minima are
    −8d / −16d, which the kernel then applies in integers; the minima are dropped unchecked); q8_0 /
    iq4_nl blocks -> q8_0_r8 / iq4_nl_r8, q4_k / q5_k / q6_k -> q4_k_r8 / q5_k_r8 / q6_k_r8 (`minima` unused)."""
    if w.kind not in ("q4_1", "q5_1", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k"):
        raise ValueError(f"only q4_1 / q5_1 / q8_0 / iq4_nl / q4_k / q5_k / q6_k blocks interleave, got {w.kind}")
    n, nb = w.n, w.k // BLOCK
    groups = (n + 7) // 8
    count = torch.tensor([n], dtype=torch.int64)
    if w.kind == "q6_k":  # the low nibbles as q4_1_r8's; bits 4-5 and the scales per 16 grouped
        four = interleave_r8(BlockWeights("q4_1", w.qs, w.d.new_zeros(n, nb), None, n, w.k), minima=False)
        q, _, _ = w.unpack()
        high = ((q.to(torch.int16) + 32) >> 4).view(n, nb, 2, 4, 4)  # [N, nb, half, j, k]: value 16·half + 4j + k
        planes = (high << (2 * torch.arange(4)).view(4, 1)).sum(3)  # [N, nb, half, k]
        padded = torch.zeros(groups * 8, nb, 2, 4, dtype=torch.uint8)
        padded[:n] = planes.to(torch.uint8)
        q2 = padded.view(groups, 8, nb, 2, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 64).contiguous()
        sc = torch.zeros(groups * 8, nb, 2, dtype=torch.int8)
        sc[:n] = w.sc.view(n, nb, 2)
        sc = sc.view(groups, 8, nb, 2).permute(0, 2, 3, 1).reshape(groups, nb, 16).contiguous()
        return BlockWeights("q6_k_r8", four.qs, block_minima(w.d), None, n, w.k, sc=sc, q2=q2, count=count)
    if w.kind in ("q4_k", "q5_k"):  # the nibbles (and fifth bits) as q4_1_r8's (q5_1_r8's); scales grouped
        four = interleave_r8(BlockWeights("q4_1", w.qs, w.d.new_zeros(n, nb), None, n, w.k), minima=False)
        qh = _fifth_bit_bytes(w.qh) if w.qh is not None else None
        return BlockWeights(w.kind + "_r8", four.qs, block_minima(w.d), w.m, n, w.k, qh=qh, sc=block_minima(w.sc),
                            dm=w.dm, count=count)
    if w.kind == "q8_0":  # [G, 8 outputs, nb, 8 runs, 4 values] -> [G, nb, run, output, value]
        qs = torch.zeros(groups * 8, w.k, dtype=torch.int8)
        qs[:n] = w.qs
        qs = qs.view(groups, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256).contiguous()
        return BlockWeights("q8_0_r8", qs, block_minima(w.d), None, n, w.k, count=count)
    if w.kind == "iq4_nl":  # the nibbles as q4_0_r8's
        four = interleave_r8(BlockWeights("q4_1", w.qs, w.d, None, n, w.k), minima=False)
        return BlockWeights("iq4_nl_r8", four.qs, four.d, None, n, w.k, count=count)
    if w.kind == "q5_1":
        four = interleave_r8(BlockWeights("q4_1", w.qs, w.d, w.m, n, w.k), minima)
        return BlockWeights("q5_1_r8" if minima else "q5_0_r8", four.qs, four.d, four.m, n, w.k,
                            qh=_fifth_bit_bytes(w.qh), count=four.count)
    # (a file's blocks are written in this layout by the repack's C++ pass: this is `quantize="int4"`'s way)
    qs = torch.zeros(groups * 8, nb, 16, dtype=torch.uint8)
    qs[:n] = w.qs.view(n, nb, 16)
    # [G, 8 outputs, nb, 4 runs, 4 bytes] -> [G, nb, run, output, byte]
    qs = qs.view(groups, 8, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 128).contiguous()
    d = block_minima(w.d)  # [G, nb, 8], as the minima are grouped
    return BlockWeights("q4_1_r8" if minima else "q4_0_r8", qs, d, w.m if minima else None, n, w.k,
                        count=torch.tensor([n], dtype=torch.int64))


def deinterleave_r8(w: BlockWeights, ids: torch.Tensor | None = None) -> BlockWeights:
    """The inverse of `interleave_r8`, as plain q4_1 / q5_1 / q8_0 / iq4_nl blocks (q4_0_r8 / q5_0_r8: minima
    −8d / −16d in float16, which `unpack` forms in float32 instead); with `ids` (int64 [R], each below N)
    only those outputs, each gathered from its group's lane (an embedding lookup reads no more)."""
    nb = w.k // BLOCK
    ids = torch.arange(w.n) if ids is None else ids
    group, lane, r = ids // 8, ids % 8, int(ids.numel())
    runs = 8 if w.kind == "q8_0_r8" else 4  # of 4 bytes per output and block
    qs = w.qs.view(-1, nb, runs, 8, 4)[group, :, :, lane, :].reshape(r, nb * runs * 4)  # [R, nb, run, byte]
    d = w.d[group, :, lane]  # [R, nb] (K layouts: [R, nb / 8], ds)
    if w.kind == "q6_k_r8":  # q − 32 from the nibbles and bits 4-5, the scales per 16 back in order
        nib = qs.view(r, nb, 16)
        low = torch.cat([nib & 0x0F, nib >> 4], dim=-1).view(r, nb, 2, 4, 4)  # [R, nb, half, j, k]
        planes = w.q2.view(-1, nb, 2, 8, 4)[group, :, :, lane, :]  # [R, nb, half, k]
        high = (planes.unsqueeze(3) >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3  # [R, nb, half, j, k]
        q = ((low | (high << 4)).to(torch.int8) - 32).view(r, w.k)
        sc = w.sc.view(-1, nb, 2, 8)[group, :, :, lane].reshape(r, nb * 2)
        return pack_q6_k(q, d.float(), sc)
    if w.kind in ("q4_k_r8", "q5_k_r8"):
        qh = None if w.qh is None else _fifth_bit_words(w.qh.view(-1, nb, 8, 4)[group, :, lane, :])
        return BlockWeights(w.kind[:-3], qs, d, block_minima(w.m[group, :, lane]), r, w.k, qh,
                            w.sc[group, :, lane].contiguous(), block_minima(w.dm[group, :, lane]))
    if w.kind in ("q8_0_r8", "iq4_nl_r8"):
        return BlockWeights(w.kind[:-3], qs, d, None, r, w.k)
    five = w.qh is not None
    m = block_minima(w.m[group, :, lane] if w.m is not None else (-(16 if five else 8) * d.float()).half())
    if five:
        return BlockWeights("q5_1", qs, d, m, r, w.k, _fifth_bit_words(w.qh.view(-1, nb, 8, 4)[group, :, lane, :]))
    return BlockWeights("q4_1", qs, d, m, r, w.k)


def pack_q4_1_r8(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] in 0..15, d and m [N, K/32] holding float16 values, as q4_1_r8."""
    return interleave_r8(pack_q4_1(q, d, m))


def pack_q4_0_r8(q: torch.Tensor, d: torch.Tensor) -> BlockWeights:
    """GGUF Q4_0: q uint8 [N, K] in 0..15, d [N, K/32] holding float16 values (w = d·(q − 8)), as q4_0_r8."""
    n, k = q.shape
    _check_k(k)
    return interleave_r8(BlockWeights("q4_1", pack_nibbles(q), _exact_half(d, "d"), None, n, k), minima=False)


def pack_q5_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] in 0..31, d and m [N, K/32] holding float16 values."""
    n, k = q.shape
    _check_k(k)
    return BlockWeights("q5_1", pack_nibbles(q), _exact_half(d, "d"), block_minima(_exact_half(m, "m")), n, k,
                        fifth_bit_words(q))


def pack_k_quant(q: torch.Tensor, ds: torch.Tensor, sc: torch.Tensor, dm: torch.Tensor, mq: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] in 0..15 (q4_k) or 0..31 (q5_k, where any value needs a fifth bit), ds and dm
    [N, K/256] holding float16 values (dm: −dmin), sc and mq [N, K/32] integers in 0..63."""
    n, k = q.shape
    if k % 256:
        raise ValueError(f"K-quant blocks need K divisible by 256, got {k}")
    five = bool((q >= 16).any())
    return BlockWeights("q5_k" if five else "q4_k", pack_nibbles(q), _exact_half(ds, "ds"),
                        block_minima(mq.to(torch.uint8)), n, k, fifth_bit_words(q) if five else None,
                        sc.to(torch.uint8).contiguous(), block_minima(_exact_half(dm, "dm")))


def pack_q6_k(q: torch.Tensor, ds: torch.Tensor, sc: torch.Tensor) -> BlockWeights:
    """q int8 [N, K] in −32..31, ds [N, K/256] holding float16 values, sc int8 [N, K/16]."""
    n, k = q.shape
    if k % 256:
        raise ValueError(f"K-quant blocks need K divisible by 256, got {k}")
    u = (q.to(torch.int16) + 32).to(torch.uint8)
    return BlockWeights("q6_k", pack_nibbles(u), _exact_half(ds, "ds"), None, n, k, sc=sc.to(torch.int8).contiguous(),
                        q2=two_bit_planes(u).contiguous())


def pack_q3_k(q: torch.Tensor, ds: torch.Tensor, sc: torch.Tensor) -> BlockWeights:
    """q int8 [N, K] in −4..3, ds [N, K/256] holding float16 values, sc int8 [N, K/16] in −32..31."""
    n, k = q.shape
    if k % 256:
        raise ValueError(f"K-quant blocks need K divisible by 256, got {k}")
    if q.min() < -4 or q.max() > 3 or sc.min() < -32 or sc.max() > 31:
        raise ValueError("Q3_K values must lie in -4..3 and its scales in -32..31")
    u = (q.to(torch.int16) + 4).to(torch.uint8)
    return BlockWeights("q3_k", pack_k_fields(u & 3), _exact_half(ds, "ds"), None, n, k,
                        sc=sc.to(torch.int8).contiguous(), q2=pack_k_masks(u >> 2))


def pack_q2_k(q: torch.Tensor, ds: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] in 0..3, ds and dmin [N, K/256] holding float16 values, sc and mn [N, K/16] in
    0..15: w = ds·sc·q − dmin·mn."""
    n, k = q.shape
    if k % 256:
        raise ValueError(f"K-quant blocks need K divisible by 256, got {k}")
    if q.max() > 3 or sc.max() > 15 or mn.max() > 15 or min(q.min(), sc.min(), mn.min()) < 0:
        raise ValueError("Q2_K values must lie in 0..3 and its scales and minima in 0..15")
    d = torch.stack([_exact_half(ds, "ds"), _exact_half(dmin, "dmin")], dim=-1).reshape(n, -1).contiguous()
    return BlockWeights("q2_k", pack_k_fields(q), d, None, n, k,
                        sc=(sc.to(torch.uint8) | (mn.to(torch.uint8) << 4)).contiguous())


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 tensor of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def arrange_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """int32 [N, nb] GGUF fifth-bit words (bit j: value j of the block) <-> the kernel's arrangement
    (its own inverse): for each block pair (b, b+1), word b = bits 0-15 of b's then bits 0-15 of
    b+1's, word b+1 = bits 16-31 of b's then bits 16-31 of b+1's (the halves the kernel reads
    together); a lone last block keeps its word."""
    w = qh.long() & 0xFFFFFFFF
    out = w.clone()
    pairs = (w.shape[1] // 2) * 2
    a, b = w[:, 0:pairs:2], w[:, 1:pairs:2]
    out[:, 0:pairs:2] = (a & 0xFFFF) | ((b & 0xFFFF) << 16)
    out[:, 1:pairs:2] = (a >> 16) | (b & 0xFFFF0000)
    return _as_int32(out).contiguous()


def block_minima(m: torch.Tensor) -> torch.Tensor:
    """float16 [N, nb] -> [⌈N/8⌉, nb, 8]: per group of 8 outputs, block by block, their 8 minima (the
    last group padded with zeros)."""
    n, nb = m.shape
    padded = torch.zeros((n + 7) // 8 * 8, nb, dtype=m.dtype)
    padded[:n] = m
    return padded.view(-1, 8, nb).transpose(1, 2).contiguous()


def unblock_minima(m: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `block_minima`: [⌈N/8⌉, nb, 8] -> [N, nb]."""
    return m.transpose(1, 2).reshape(-1, m.shape[1])[:n]


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> BlockWeights:
    """q int8 [N, K], d [N, K/32] holding float16 values."""
    n, k = q.shape
    _check_k(k)
    return BlockWeights("q8_0", q.to(torch.int8).contiguous(), _exact_half(d, "d"), None, n, k)


def pack_q8_0_r8(q: torch.Tensor, d: torch.Tensor) -> BlockWeights:
    """q int8 [N, K], d [N, K/32] holding float16 values, as q8_0_r8."""
    return interleave_r8(pack_q8_0(q, d))


def pack_iq4_nl(q: torch.Tensor, d: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] level indices in 0..15, d [N, K/32] holding float16 values."""
    n, k = q.shape
    _check_k(k)
    return BlockWeights("iq4_nl", pack_nibbles(q), _exact_half(d, "d"), None, n, k)


def pack_iq4_xs(q: torch.Tensor, ds: torch.Tensor, sc: torch.Tensor) -> BlockWeights:
    """q uint8 [N, K] level indices in 0..15, ds [N, K/256] holding float16 values, sc int8 [N, K/32] in
    −32..31 (the file's 6-bit scales − 32): w = ds·sc·IQ4_NL_LEVELS[q]."""
    n, k = q.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"IQ4_XS blocks need K divisible by 256, got {k}")
    if q.min() < 0 or q.max() > 15 or sc.min() < -32 or sc.max() > 31:
        raise ValueError("IQ4_XS level indices must lie in 0..15 and its scales in -32..31")
    return BlockWeights("iq4_xs", pack_nibbles(q), _exact_half(ds, "ds"), None, n, k, sc=sc.to(torch.int8).contiguous())


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"block weights need K divisible by {BLOCK}, got {k}")


def _exact_half(t: torch.Tensor, name: str) -> torch.Tensor:
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t.float()):
        raise ValueError(f"block scale {name} is not a float16 value (the GGUF blocks hold float16)")
    return h.contiguous()


# ----------------------------------------------------------------------------- products
PLAIN, RMS_NORM, SWIGLU = 0, 1, 2  # what the kernel does to a row before quantizing it


def gemm(x: torch.Tensor, w: BlockWeights, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [T, K] times w [N, K] transposed -> float32 [T, N], with optional fusions:

    norm_weight [K]: the rows are RMS-normalized first (w ⊙ x / sqrt(mean(x²) + eps)).
    swiglu: x is [T, 2K] = [gate | up] and the product takes silu(gate) ⊙ up.
    residual [T, N]: returned is residual + the product.
    """
    ext = _extension()
    if norm_weight is not None and swiglu:
        raise ValueError("one prologue at a time: norm_weight or swiglu")
    mode = RMS_NORM if norm_weight is not None else SWIGLU if swiglu else PLAIN
    return getattr(ext, f"gemm_{w.kind}")(x, *w.kernel_arrays(), mode, norm_weight, eps, residual)


def dense_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 x [T, B, K] times w [B, N, K] transposed, per b -> [T, B, N] (batched F.linear), each
    output one dot product in a fixed order whatever T: a row's result depends on that row alone
    (PyTorch's products choose other kernels for few rows)."""
    return _extension().dense_rows(x, w)


def repack_rows(type_name: str, raw: torch.Tensor, row0: int, qs: torch.Tensor, d: torch.Tensor,
                m: torch.Tensor | None = None, qh: torch.Tensor | None = None, sc: torch.Tensor | None = None,
                mq: torch.Tensor | None = None, q2: torch.Tensor | None = None,
                order: torch.Tensor | None = None, outputs: int = -1) -> int:
    """GGUF blocks of `type_name` as stored (uint8 [r, row bytes]) -> rows row0 .. row0 + r of the
    kernel's arrays (before `block_minima` groups m / mq / dm), in one C++ pass (see
    `models.quant.stored_block_weights`); with `order` (int64 [r']) the stored rows order[0], order[1],
    ... instead (GGUF's q / k row order, gathered in the pass); `outputs`: N, for the interleaved layouts
    (qs [⌈N/8⌉, K/32, 128 or 256]); returns how many Q4_0 / Q5_0 blocks' minimum overflows float16."""
    return _extension().repack_rows(type_name, raw, row0, qs, d, m, qh, sc, mq, q2, order, outputs)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own activation quantization (for tests): q int8 [T, K], d, d·Σq float32 [T, K/32]."""
    q, d, s = _extension().quantize_q8(x)
    return q, d, s


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization for K-quant weights (for tests): q int8 [T, K], d float32
    [T, K/256], sums of each 16 q int16 [T, K/16]."""
    q, d, sums = _extension().quantize_q8_k(x)
    return q, d, sums


def quantize_q8_k_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_q8_reference`'s rule over super-blocks of 256 values, and the sums of each 16 q."""
    t, k = x.shape
    q, d, _ = quantize_q8_reference(x, block=SUPER_BLOCK)
    return q, d, q.view(t, k // 16, 16).sum(-1, dtype=torch.int16)


def quantize_q8_reference(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and block of 32 (`block`): d = max|x| / 127, q = round_half_even(x · (1/d)), s = d · Σq
    (d below the smallest normal float: q = 0; a non-finite value in the block: d = s = NaN, q = 0)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // block, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d >= torch.finfo(torch.float32).tiny, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)
    s = d * q.sum(-1)
    bad = ~torch.isfinite(xb).all(-1)  # a NaN / inf in the block: scales NaN, values 0
    q = torch.where(bad.unsqueeze(-1), torch.zeros_like(q), q)
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return q.to(torch.int8).reshape(t, k), d, s


# the interleaved K-quant layouts, whose activations' block depends on the build (`activation_block`)
K_R8_KINDS = ("q4_k_r8", "q5_k_r8", "q6_k_r8")


def activation_block(kind: str, vnni: bool | None = None) -> int:
    """How many values of a row share one activation scale in `kind`'s products: 256 for the K-quant
    layouts (as ggml's Q8_K), and for their interleaved ones on the AVX2 build (its tiles then sum a
    super-block's 8 blocks in integers, one float step a super-block); 32 elsewhere (the VNNI build's
    interleaved K tiles included). vnni: the build (None: the one this CPU loads, `uses_vnni`)."""
    if kind in SUPER_BLOCK_KINDS:
        return SUPER_BLOCK
    if kind in K_R8_KINDS:
        return BLOCK if (uses_vnni() if vnni is None else vnni) else SUPER_BLOCK
    return BLOCK


def gemm_reference(x: torch.Tensor, w: BlockWeights, *, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, swiglu: bool = False, residual: torch.Tensor | None = None,
                   vnni: bool | None = None) -> torch.Tensor:
    """The slow, obvious product: the prologue in float32 PyTorch operators, integer block sums in
    int64, scales applied in float64; the activations quantized per `activation_block(w.kind, vnni)`."""
    if norm_weight is not None:
        x = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if residual is not None:
        return residual + gemm_reference(x, w, vnni=vnni)
    if w.kind in HALF_KINDS:  # float weights: the product in float64 on the widened values
        return (x.double() @ w.values().double().T).float()
    t, k = x.shape
    act_block = activation_block(w.kind, vnni)
    qx, dx, sx = quantize_q8_reference(x, block=act_block)
    qw, dw, mw = w.unpack()
    ng = dw.shape[1]  # groups of values sharing a weight scale: blocks of 32 (q6_k / q3_k / q2_k: halves of 16)
    g = k // ng
    isum = torch.einsum("tbi,obi->tob", qx.long().view(t, ng, g), qw.long().view(w.n, ng, g))  # [T, N, ng]
    dxg = dx.repeat_interleave(act_block // g, dim=1)
    y = (isum.double() * dxg.double().unsqueeze(1) * dw.double().unsqueeze(0)).sum(-1)
    if mw is not None:  # minima per block of 32 (q2_k: 16): the row's dx·Σq over each
        gm = k // mw.shape[1]
        sx = dx.repeat_interleave(act_block // gm, dim=1) * qx.view(t, k // gm, gm).sum(-1).float()
        y = y + sx.double() @ mw.double().t()
    return y.float()
