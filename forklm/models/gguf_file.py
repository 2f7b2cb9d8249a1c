"""A GGUF file's metadata and tensor table, read in one pass over the memory-mapped file.

Why not `gguf.GGUFReader`: it builds a numpy view per array element, 4-8 s for a vocabulary of 50k
tokens and merges on a 2-core machine (llama.cpp loads the same file in a quarter of a second); this
reader slices string arrays out of the header bytes and numeric arrays with one `frombuffer`
(~0.1 s). Tensor data stays in the mapping: each tensor's `data` is a view of the file, shaped as
GGUFReader shapes it (quantized types: uint8 [rows, bytes per row]; float types: their values with
dims slowest first), so the gguf package's dequantization takes it as is.

    meta, tensors = read_gguf(path)   # meta: {key: python value}; tensors: [GGUFTensor]
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ggml's tensor types: name -> (id, values per block, bytes per block), as the `gguf` package's
# GGMLQuantizationType and GGML_QUANT_SIZES hold them (tests/test_gguf_loader.py checks they agree);
# kept here because importing `gguf` (its metadata helpers pull in yaml) costs a tenth of a load.
_GGML_TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q8_1": (9, 32, 40),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66),
    "IQ2_XS": (17, 256, 74),
    "IQ3_XXS": (18, 256, 98),
    "IQ1_S": (19, 256, 50),
    "IQ4_NL": (20, 32, 18),
    "IQ3_S": (21, 256, 110),
    "IQ2_S": (22, 256, 82),
    "IQ4_XS": (23, 256, 136),
    "I8": (24, 1, 1),
    "I16": (25, 1, 2),
    "I32": (26, 1, 4),
    "I64": (27, 1, 8),
    "F64": (28, 1, 8),
    "IQ1_M": (29, 256, 56),
    "BF16": (30, 1, 2),
    "TQ1_0": (34, 256, 54),
    "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17),
    "NVFP4": (40, 64, 36),
    "Q1_0": (41, 128, 18),
}
GGMLType = enum.IntEnum("GGMLType", {name: t[0] for name, t in _GGML_TYPES.items()})
GGML_BLOCK_SIZES = {GGMLType[name]: (t[1], t[2]) for name, t in _GGML_TYPES.items()}

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (the scalar ones)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers (GGUFReader's dtypes); every other type is blocks of bytes
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml's ne order: fastest-varying dim first (as GGUFReader's .shape)
    tensor_type: Any  # GGMLType (equal to gguf.GGMLQuantizationType of the same id)
    data: np.ndarray  # a view of the mapped file (see module docstring)
    n_bytes: int


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): in one C call where forklm's string
        reader is built (`native_strings`), else `python_strings`; the same list either way."""
        native = native_strings()
        if native is None:
            return self.python_strings(count)
        out, self.pos = native.read_strings(self.buf, self.pos, count)
        return out

    def python_strings(self, count: int) -> list[str]:
        """`strings` in Python: `string` without the per-item calls."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("string runs past the end of the file")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("string runs past the end of the file")
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


_STRINGS_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "gguf_strings.cpp"


@functools.lru_cache(maxsize=1)
def native_strings():
    """The C++ string reader (kernels/csrc/gguf_strings.cpp: `read_strings`, `split_pairs`), built once
    per machine like forklm's kernels, or None where it does not build (said once, as a warning:
    the Python loop then reads the same strings, ~0.1 s slower for a 49k vocabulary).
    FORKLM_NATIVE_STRINGS=0 turns it off."""
    import os

    global _strings_error
    if os.environ.get("FORKLM_NATIVE_STRINGS", "1") == "0":
        _strings_error = "disabled by FORKLM_NATIVE_STRINGS=0"
        return None
    from forklm.kernels import native

    try:
        module = native.load_extension("forklm_gguf_strings", _STRINGS_SOURCE, ["-O2"])
    except Exception as e:  # noqa: BLE001 - no compiler or no ninja: the Python loop instead
        _strings_error = native._one_line(e)
        native.warn_once("GGUF string reader", _strings_error, "a Python loop reads the vocabulary instead")
        return None
    _strings_error = None
    return module


_strings_error: str | None = None


def string_reader_error() -> str | None:
    """None when the C++ string reader runs here (building it on first call), else why not."""
    native_strings()
    return _strings_error


def split_pairs(strings: list[str]) -> list[tuple[str, ...]]:
    """Each string split at every " " (a merge "a b" -> ("a", "b")), in one C call where built."""
    native = native_strings()
    if native is None:
        return [tuple(s.split(" ")) for s in strings]
    return native.split_pairs(strings)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def release_pages(view) -> None:
    """Drops the pages of a view of the read-only file mapping from this process's resident set
    (madvise DONTNEED: they stay in the page cache and read back on a later touch). Called once a
    tensor is repacked into memory of its own, so the file's copy and the repacked one are never both
    counted at the peak. A no-op where madvise is unavailable."""
    import ctypes
    import mmap

    libc = _libc()
    if libc is None:
        return
    addr = view.data_ptr() if hasattr(view, "data_ptr") else view.ctypes.data
    nbytes = view.numel() * view.element_size() if hasattr(view, "numel") else view.nbytes
    page = mmap.PAGESIZE
    start, end = (addr + page - 1) // page * page, (addr + nbytes) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF v2/v3 little-endian file; ValueError on a bad or truncated one."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if len(buf) < 24 or bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a huge version)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has tensor type id {type_id}, which ggml does not define") from None
        block, size = GGML_BLOCK_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        n_bytes = n_elems // block * size
        begin = start + offset
        if begin + n_bytes > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        rows = tuple(reversed(dims))  # slowest first
        if type_id in _PLAIN:
            data = mm[begin:begin + n_bytes].view(_PLAIN[type_id]).reshape(rows)
        else:
            data = mm[begin:begin + n_bytes].reshape(*rows[:-1], rows[-1] // block * size)
        tensors.append(GGUFTensor(name, dims, qtype, data, n_bytes))
    return meta, tensors
