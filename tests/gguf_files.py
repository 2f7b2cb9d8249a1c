"""Real GGUF files for the tests, made from the default model's file: its tensors' values requantized
by ggml itself (the routine llama-quantize calls) to a per-tensor type rule, written with the gguf
package's writer, metadata and tokenizer copied. (llama-quantize itself needs llama.cpp's full build,
10+ minutes; the benchmark uses it, `python -m bench sweep --llama-cpp --presets`.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# llama.cpp's sources, which scripts/build_ggml.sh (run by the set-up) unpacks
CONVERTER = (Path(os.environ.get("FORKLM_LLAMA_CPP_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "llama.cpp")
             / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")
SMOLLM2_VOCAB = 49152


def convert_hf_folder(folder: Path, out: Path, smollm2_gguf: Path) -> Path:
    """`out`: the transformers checkpoint in `folder` as llama.cpp's convert_hf_to_gguf.py writes it
    (float32), over the default model's tokenizer (a byte-level BPE the converter knows) saved beside it."""
    from forklm.models.gguf_file import read_gguf
    from forklm.tokenizer import Tokenizer

    assert CONVERTER.exists(), f"{CONVERTER} not present: run scripts/setup.sh (scripts/build_ggml.sh unpacks it)"
    meta, _ = read_gguf(smollm2_gguf)
    Tokenizer.from_gguf_fields(meta)._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "tokenizer_class": "GPT2Tokenizer"}))
    r = subprocess.run([sys.executable, str(CONVERTER), str(folder), "--outfile", str(out), "--outtype", "f32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


# A file holding every type forklm runs as stored: the layers cycle through these. SmolLM2's
# hidden size (576) is no multiple of 256, so K-quants fit only ffn_down (1536 inputs), as in
# llama-quantize's own fall-backs.
ZOO_32 = ["Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q8_0", "Q4_1", "F16", "BF16"]
ZOO_256 = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"]


def zoo_type(name: str, k: int) -> str | None:
    """The type rule of the "zoo" file: None keeps the tensor as it is."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if name == "token_embd.weight":
        return "Q6_K" if k % 256 == 0 else "Q8_0"
    if not m:
        return None
    layer, part = int(m[1]), m[2]
    if part == "ffn_down" and k % 256 == 0:
        return ZOO_256[layer % len(ZOO_256)]
    if part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        # q, k and v of one layer in different types: a fused product of mixed parts
        shift = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "attn_output": 3, "ffn_gate": 4, "ffn_up": 4, "ffn_down": 5}
        return ZOO_32[(layer + shift[part]) % len(ZOO_32)]
    return None


def low_bit_type(name: str, k: int) -> str | None:
    """llama-quantize's Q2_K / Q3_K_M presets on SmolLM2 with the K-quants forced where rows fit:
    ffn_down (1536 inputs) Q2_K in even layers and Q3_K in odd ones, every other matrix Q4_0 (the
    presets' fall-back for 576-wide rows), the embedding as it is."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if not m or m[2] in ("attn_norm", "ffn_norm"):
        return None
    if m[2] == "ffn_down" and k % 256 == 0:
        return "Q3_K" if int(m[1]) % 2 else "Q2_K"
    return "Q4_0"


def iq4_type(name: str, k: int) -> str | None:
    """llama-quantize's IQ4_XS preset on SmolLM2: ffn_down (1536 inputs) IQ4_XS, every other matrix
    IQ4_NL (the preset's fall-back for 576-wide rows), the embedding as it is."""
    m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", name)
    if not m or m[1] in ("attn_norm", "ffn_norm"):
        return None
    return "IQ4_XS" if m[1] == "ffn_down" and k % 256 == 0 else "IQ4_NL"


def k_quant_type(name: str, k: int) -> str | None:
    """A Q4_K_M-like rule: Q4_K where a row is a multiple of 256, else Q5_0; attn_v and ffn_down Q6_K
    where they fit, else Q8_0; the embedding Q8_0."""
    if name == "token_embd.weight":
        return "Q8_0"
    m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", name)
    if not m or m[1] in ("attn_norm", "ffn_norm"):
        return None
    big = m[1] in ("attn_v", "ffn_down")
    if k % 256 == 0:
        return "Q6_K" if big else "Q4_K"
    return "Q8_0" if big else "Q5_0"


def requantize(src: Path, dst: Path, rule: Callable[[str, int], str | None], *, fields: dict | None = None,
               drop: Callable[[str], bool] = lambda name: False, add: dict | None = None) -> Path:
    """Writes `dst`: `src` with every tensor the rule names requantized (from its float values; a 3-D
    stack of experts row by row), metadata `fields` ({key: (value, gguf.GGUFValueType)}, value None:
    the key removed) set, the tensors `drop` names left out, float32 tensors `add` ({name: array in
    the Hugging Face dim order}) added."""
    import gguf

    from forklm.kernels import ggml_gemm

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    fields = fields or {}
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in fields:
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for key, (value, vtype) in fields.items():
        if value is not None:
            writer.add_key_value(key, value, vtype)
    for name, values in (add or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    for t in reader.tensors:
        if drop(t.name):
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # ([experts,] rows, k)
        want = rule(t.name, shape[-1]) if len(shape) in (2, 3) else None
        if want is None or want == t.tensor_type.name:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        values = torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        if want in ("F16", "BF16"):
            data = values.to(torch.float16 if want == "F16" else torch.bfloat16).view(torch.uint8)
        else:
            data = ggml_gemm.quantize(values.reshape(-1, shape[-1]), want).data
            data = data.reshape(*shape[:-1], data.shape[-1])
        qtype = gguf.GGMLQuantizationType[want]
        writer.add_tensor(t.name, data.numpy(), raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
