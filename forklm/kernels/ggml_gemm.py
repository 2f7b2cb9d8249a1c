"""GGUF tensors of any common type kept as the file stores them and multiplied through ggml's own
CPU dot products (csrc/ggml_gemm.cpp over libggml-cpu, which `scripts/build_ggml.sh` builds from the
same llama.cpp sources forklm benchmarks against).

Which types come here: those forklm's block kernel (block_gemm.py) does not run (F32 matrices, and
F16 / BF16 ones whose rows are not a multiple of 32), a Q4_0 / Q5_0 tensor whose minimum overflows
float16, and every GGUF product where the block kernel is not built. ggml's kernels are llama.cpp's
own, so such a file's arithmetic is the one its publisher measured; the block kernel's multi-row tiles are 2-3.5x faster from 8 rows on the types
both run, so those go there. Each activation row is converted to the type's
`vec_dot_type` (Q8_0 / Q8_1 / Q8_K blocks or F16 / BF16) on its own and each output is one
`vec_dot` of a weight row with an activation row: a row's result depends on that row alone,
whatever the number of rows.

    w = GGMLWeights.from_rows(raw, "Q4_K", k)   # raw: uint8 [N, row_bytes], the file's bytes
    y = gemm(x, w)                              # x float32 [T, K] -> y float32 [T, N]

Where ggml lives: FORKLM_GGML_DIR, else `.cache/ggml-<version>` beside the package (what
scripts/setup.sh builds). FORKLM_GGML=0 turns these kernels off (such files are then refused).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from forklm.kernels.block_gemm import cpu_supports

_SOURCE = Path(__file__).parent / "csrc" / "ggml_gemm.cpp"
GGML_SOURCES_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp builds ggml

# The GGUF tensor types forklm runs as stored through ggml (name -> ggml type id, as gguf numbers them).
# Q4_1 and Q8_0 run on forklm's own block kernel where it builds (forklm/kernels/block_gemm.py).
GGML_TYPE_IDS = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30,
}


def ggml_dir() -> Path:
    """Where libggml-cpu and its headers are installed (FORKLM_GGML_DIR, else the repo's .cache), as an
    absolute path: the linker runs in the build's own folder, where a relative one names nothing."""
    env = os.environ.get("FORKLM_GGML_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / ".cache" / f"ggml-{GGML_SOURCES_VERSION}"


@lru_cache(maxsize=1)
def _extension():
    from forklm.kernels import native

    root = ggml_dir()
    lib = root / "lib"
    if not (lib / "libggml-cpu.so").exists():
        raise FileNotFoundError(f"no ggml build at {root} (run scripts/build_ggml.sh, or set FORKLM_GGML_DIR)")
    # the ggml folder is in the build's key (its include path and rpath): another ggml, another build
    return native.load_extension("forklm_ggml_gemm", _SOURCE, ["-O3", "-fopenmp"],
                                 ["-fopenmp", f"-L{lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib}"],
                                 [str(root / "include")])


@lru_cache(maxsize=1)
def build_error() -> str | None:
    """None when the kernels are built and loaded (building them on first call), else why not (said
    once, as a warning)."""
    if os.environ.get("FORKLM_GGML", "1") == "0":
        return "disabled by FORKLM_GGML=0"
    if not cpu_supports():
        reason = "this CPU is not x86-64 with AVX2, FMA and F16C"
    else:
        try:
            _extension()
            return None
        except Exception as e:  # noqa: BLE001 - reported, and every file that needs it is refused by name
            text = str(e).strip()
            reason = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
    warnings.warn(f"forklm: ggml's CPU kernels (GGUF types the block kernel does not run) are not available: {reason}",
                  RuntimeWarning, stacklevel=2)
    return reason


def available() -> bool:
    return build_error() is None


def vec_dot_type(type_name: str) -> str:
    """The type ggml converts activations to for weights of `type_name` (e.g. Q4_K -> q8_K)."""
    return _extension().vec_dot_type(GGML_TYPE_IDS[type_name])


@dataclass
class GGMLWeights:
    """A weight [n, k] as a GGUF file stores it: n rows of ggml blocks (uint8 [n, row_bytes], often a
    view of the memory-mapped file). row_order: the Hugging Face row i is stored row row_order[i]
    (llama.cpp's q/k rope permutation), None: the stored order."""

    data: torch.Tensor  # uint8 [n, row_bytes]
    type_name: str  # "Q4_K", "F16", ...
    n: int
    k: int
    row_order: torch.Tensor | None = None  # int64 [n]
    mapped: bool = False  # data is a view of the read-only file mapping (its pages may be released)

    @property
    def kind(self) -> str:
        return self.type_name.lower()

    @property
    def type_id(self) -> int:
        return GGML_TYPE_IDS[self.type_name]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def stored_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The stored bytes of Hugging Face rows `ids` (uint8 [len(ids), row_bytes])."""
        if self.row_order is not None:
            ids = self.row_order[ids]
        return self.data[ids].contiguous()

    def output_columns(self) -> torch.Tensor:
        """int64 [n]: the output column each stored row's product lands in (empty: its own)."""
        if self.row_order is None:
            return torch.empty(0, dtype=torch.int64)
        return torch.argsort(self.row_order).contiguous()

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k] in Hugging Face row order: the values ggml's own dequantization gives (the
        gguf package's, equal, where ggml's kernels do not run)."""
        y = _dequantize_stored(self.data, self.type_name, self.k)
        return y if self.row_order is None else y[self.row_order]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return _dequantize_stored(self.stored_rows(ids), self.type_name, self.k)

    def row_range(self, start: int, stop: int) -> "GGMLWeights":
        """Stored rows start..stop-1 as a weight of their own (a view: one expert of a stacked tensor)."""
        if self.row_order is not None:
            raise ValueError("row_range of a permuted weight")
        return GGMLWeights(self.data[start:stop], self.type_name, stop - start, self.k, mapped=self.mapped)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def num_bytes(self) -> int:
        return self.data.numel()


def _dequantize_stored(data: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    if available():
        return _extension().dequantize(data, GGML_TYPE_IDS[type_name], k)
    import gguf
    import numpy as np

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(data.shape[0], k))


def gemm(x: torch.Tensor, w: GGMLWeights) -> torch.Tensor:
    """x float32 [T, K] -> x @ wᵀ float32 [T, N] (activations converted per row, as llama.cpp does)."""
    return gemm_parts(x, [w])


def gemm_parts(x: torch.Tensor, parts: list[GGMLWeights]) -> torch.Tensor:
    """x float32 [T, K] -> [T, sum of the parts' n]: the products of weights fused along `out` (each
    part its own type), activations converted once per dot-product type."""
    return _extension().gemm_parts(x, [p.data for p in parts], [p.type_id for p in parts],
                                   [p.output_columns() for p in parts], parts[0].k)


def quantize(values: torch.Tensor, type_name: str) -> GGMLWeights:
    """float32 [n, k] -> GGMLWeights of `type_name`, quantized row by row by ggml itself (the bytes
    llama-quantize would write for these values, without an importance matrix)."""
    data = _extension().quantize(values.float().contiguous(), GGML_TYPE_IDS[type_name])
    return GGMLWeights(data, type_name, values.shape[0], values.shape[1])


def gemm_reference(x: torch.Tensor, w: GGMLWeights, dequantized: torch.Tensor) -> torch.Tensor:
    """The slow, obvious product the tests hold `gemm` to: float64 activations times the weights'
    float values (`dequantized`: an independent dequantization, e.g. the gguf package's)."""
    return (x.double() @ dequantized.double().t()).float()
