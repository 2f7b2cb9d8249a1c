"""The backend layer (forklm/backend.py): placement resolved once per model, received by the loader,
the model, the engine and the drafter; fall-backs named once at load; kernels import no models."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from forklm import backend
from forklm.backend import Backend
from forklm.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_kernels_import_no_model_code_and_the_drafter_no_front_end():
    for path in sorted((ROOT / "forklm" / "kernels").glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(("forklm.models", "forklm.llm", "forklm.engine")))
        assert not bad, f"{path.name} imports {bad}"
    for path in sorted((ROOT / "forklm" / "speculative").glob("*.py")):
        assert "forklm.llm" not in _imports(path), f"{path.name} imports the LLM front end (an import cycle)"


def test_resolve_for_gguf_blocks_and_for_float_weights():
    blocks = Backend.resolve(device="cpu", quantize="auto", has_gguf_blocks=True)
    if backend.block_kernel_available():
        assert (blocks.quantize, blocks.dtype, blocks.block_kernel) == ("gguf", torch.float32, True)
        assert blocks.quantized_kernels and blocks.weight_layout == "out_in" and blocks.keeps_gguf_blocks
    else:  # the blocks are dequantized, and the reason is kept
        assert blocks.quantize is None and any("block kernel" in f for f in blocks.fallbacks)
    dense = Backend.resolve(device="cpu", dtype="float32", quantize="auto", has_gguf_blocks=False)
    assert dense.quantize is None and not dense.quantized_kernels and dense.weight_layout == "in_out"
    assert not dense.block_kernel and not dense.keeps_gguf_blocks
    bf16 = Backend.resolve(device="cpu", dtype="bfloat16", quantize=None, has_gguf_blocks=False)
    assert bf16.dtype == torch.bfloat16 and bf16.weight_layout == "out_in"


def test_decode_kernel_is_settled_by_the_model_shape_and_named_when_it_falls_back():
    f32 = Backend.exact(torch.float32, CPU)
    f32.for_model(64)
    from forklm.kernels import cpu_attention

    assert f32.decode_kernel == ("cpu" if cpu_attention.available() else "torch")
    odd = Backend.exact(torch.float32, CPU)
    odd.for_model(40)  # not a multiple of 16: PyTorch's products, and why
    assert odd.decode_kernel == "torch" and any("head dim 40" in f for f in odd.fallbacks)
    with pytest.raises(InvalidArgumentError, match="head dim 40"):
        odd.engine_decode_kernel("cpu")
    assert odd.engine_decode_kernel("auto") == "torch" and odd.engine_decode_kernel("torch") == "torch"
    with pytest.raises(InvalidArgumentError, match="decode_kernel must be"):
        odd.engine_decode_kernel("gpu")
    assert odd.kv_dtype("auto", "torch") == torch.float32
    with pytest.raises(InvalidArgumentError, match="float16"):
        odd.kv_dtype("float16", "torch")


def test_bad_backend_values_are_named():
    with pytest.raises(ValueError, match="weight_layout"):
        Backend.exact(torch.float32, CPU, weight_layout="rows")
    with pytest.raises(ValueError, match="quantize"):
        Backend.exact(torch.float32, CPU, "q4")
    with pytest.raises(ValueError, match="out_in"):
        Backend.exact(torch.float32, CPU, "int8", weight_layout="in_out")
    with pytest.raises(InvalidArgumentError, match="quantize must be"):
        Backend.resolve(device="cpu", quantize="int3", has_gguf_blocks=False)


def test_llm_model_engine_share_one_backend(smollm2_gguf):
    from forklm import LLM

    llm = LLM("smollm2-135m", device="cpu")
    assert llm.backend is llm.model.backend
    assert (llm.dtype, llm.quantize, llm.device) == (llm.backend.dtype, llm.backend.quantize, llm.backend.device)
    engine = llm.engine()
    assert engine.decode_kernel == llm.backend.decode_kernel
    assert engine.kv_dtype == llm.backend.kv_dtype("auto", engine.decode_kernel)


def test_a_fallback_is_shown_once_at_load_and_by_info(smollm2_gguf):
    """With the block kernel off, quantize='auto' dequantizes the file's blocks: one warning at load
    names why, and `forklm info` lists it."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    from forklm import LLM\n"
        "    llm = LLM('smollm2-135m', device='cpu', dtype='float32')\n"
        "mine = [str(w.message) for w in seen if str(w.message).startswith('forklm: SmolLM2')]\n"
        "print(len(mine)); print(mine[0]); print(llm.quantize)\n"
        "from forklm.info import report\n"
        "print(report(llm)['model']['fall-backs from the fast path'])\n"
    )
    env = {**__import__("os").environ, "FORKLM_BLOCK_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    count, message, quantize, fallbacks = out.stdout.strip().split("\n")
    assert count == "1" and "disabled by FORKLM_BLOCK_KERNEL=0" in message and "dequantized" in message
    assert quantize == "None" and "disabled by FORKLM_BLOCK_KERNEL=0" in fallbacks


def test_no_warning_where_the_fast_path_runs(smollm2_gguf):
    from forklm import LLM
    from forklm.kernels import cpu_attention, decode_stack

    from conftest import native_kernels_expected

    if not native_kernels_expected():
        pytest.skip("this CPU / torch cannot run forklm's C++ kernels (no AVX2 / FMA / F16C, or not GNU OpenMP)")
    assert backend.block_kernel_available() and cpu_attention.available() and decode_stack.available()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llm = LLM("smollm2-135m", device="cpu")
    assert not [w for w in seen if str(w.message).startswith("forklm:")], [str(w.message) for w in seen]
    assert llm.backend.fallbacks == []
