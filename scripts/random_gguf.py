"""GGUF files of real 1-3B model shapes with random weights, made the way users' files are made.

    .venv/bin/python scripts/random_gguf.py [--shapes llama3.2-1b,qwen2.5-1.5b] [--presets Q4_K_M,Q8_0]
        [--outtype bf16|f16] [--seed 0] [--keep] [--check] [--out .cache/random-gguf] [--no-lock]

Why: forklm's packaged model is 135M parameters; benchmarks at the sizes people run (1-3B) need
files of those shapes, and they must come out of the same pipeline as a downloaded model's, so
that tensor types, layouts, metadata and the tokenizer keys are what forklm meets in the wild.
No hub access is needed (and no real weights are used):

1. A Hugging Face checkpoint, written by transformers: `AutoModelForCausalLM.from_config` of the
   real shape's config (random init as transformers does it, normal std 0.02, under `--seed`),
   `save_pretrained` in bfloat16 safetensors (half the disk and time of float32). Peak RSS of
   any step: 4.0 GB (Qwen2.5-1.5B); ~8 min for both shapes on 2 cores, most of it Q4_K_M.
   Tokenizer: forklm's default model's (SmolLM2-135M, from the packaged GGUF, rebuilt as a
   `tokenizers` object by forklm.tokenizer) saved as tokenizer.json + a minimal
   tokenizer_config.json. It is a GPT-2 style byte-level BPE whose pre-tokenizer llama.cpp's
   converter recognizes by its hash ("smollm"). Its 49152 tokens are fewer than the shapes'
   vocab_size (128256 / 151936): the embedding keeps the real shape, and the converter pads the
   vocabulary with "[PAD<id>]" tokens of type UNUSED (get_vocab_base), as it does for real models
   whose embedding is larger than their tokenizer. config.json's bos/eos ids are the tokenizer's.
2. llama.cpp's convert_hf_to_gguf.py (vendored in the llama-cpp-python sdist built by
   scripts/build_llama_cpp.sh; run with its own gguf-py on PYTHONPATH) -> <shape>-BF16.gguf
   (or F16 with --outtype f16). It imports sentencepiece for llama/qwen2 folders before it falls
   back to the byte-level BPE path (`pip install 'sentencepiece>=0.1.98,<0.3.0'`). Under
   transformers >= 5 one setting is changed in the converter's process (see CONVERT below) so
   that a qwen2 folder's tokenizer.json is read as written.
3. llama.cpp's llama-quantize -> <shape>-<PRESET>.gguf per preset (Q4_K_M, Q8_0 by default; any
   type name llama-quantize takes).

The HF folder and the BF16/F16 file are deleted once every preset exists, unless --keep (which
also makes them again if an earlier run deleted them).
Idempotent: a step is skipped when its output exists (outputs are written under a temporary name
and renamed, so an interrupted run leaves nothing that looks done). Prints each file's path.

CPU-heavy steps (random init, conversion, quantization, --check) run holding an exclusive flock on
/tmp/forklm_bench.lock, so they do not overlap a benchmark; do not wrap this script in
`flock /tmp/forklm_bench.lock` yourself (it would wait on itself), or pass --no-lock if you do.

--check: for each preset file, forklm loads it and samples 8 x 4 tokens (peak RSS reported), and
llama.cpp's llama-batched-bench runs it (-npp 64 -ntg 4 -npl 1 -t 2).

Needs: torch, transformers, safetensors, tokenizers in the venv; llama.cpp built by
scripts/build_llama_cpp.sh (LLAMA_CPP_PYTHON_VERSION / FORKLM_LLAMA_CPP_DIR as there).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
LLAMA_ROOT = Path(os.environ.get("FORKLM_LLAMA_CPP_DIR", REPO / ".cache" / "llama.cpp"))
LLAMA_SRC = LLAMA_ROOT / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
LLAMA_BIN = LLAMA_ROOT / f"build-{VERSION}" / "bin"
LOCK = "/tmp/forklm_bench.lock"

# Hugging Face config.json keys of the real models (from their published configs); the HF folder
# name is also the GGUF's general.name. bos/eos ids are set from the tokenizer (see module doc).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3.2-1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "initializer_range": 0.02,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 28, "hidden_act": "silu", "initializer_range": 0.02,
    },  # Qwen2 has q/k/v biases (no o_proj bias) by architecture; transformers' Qwen2 builds them
}
DEFAULT_PRESETS = ("Q4_K_M", "Q8_0")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bench_lock(enabled: bool) -> Iterator[None]:
    """Holds an exclusive flock on LOCK (what `flock /tmp/forklm_bench.lock cmd` takes); child
    processes started meanwhile run under it."""
    if not enabled:
        yield
        return
    with open(LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {LOCK} (a benchmark is running)...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(cmd: list[str], env: dict[str, str] | None = None, label: str | None = None) -> None:
    log("+ " + (label or " ".join(str(c) for c in cmd)))
    t = time.time()
    subprocess.run([str(c) for c in cmd], check=True, env=env)
    log(f"  ({time.time() - t:.0f} s)")


def write_tokenizer(folder: Path) -> tuple[int, int]:
    """forklm's default model's tokenizer as tokenizer.json + tokenizer_config.json; (bos, eos) ids."""
    sys.path.insert(0, str(REPO))
    from forklm.models.gguf_file import read_gguf
    from forklm.models.registry import DEFAULT_MODEL, packaged_gguf
    from forklm.tokenizer import Tokenizer

    meta, _ = read_gguf(packaged_gguf(DEFAULT_MODEL))
    tok = Tokenizer.from_gguf_fields(meta)
    tok._tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "unk_token": tok.id_to_token(unk) if (unk := meta.get("tokenizer.ggml.unknown_token_id")) is not None else None,
        "pad_token": tok.eos_token, "add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tok.bos_token_id, tok.eos_token_ids[0]


def write_hf_folder(shape: str, folder: Path, seed: int) -> None:
    """Random-weight checkpoint of SHAPES[shape], written by transformers (bf16 safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bos, eos = write_tokenizer(tmp)
    keys = dict(SHAPES[shape])
    config = AutoConfig.for_model(keys.pop("model_type"), bos_token_id=bos, eos_token_id=eos, **keys)
    torch.manual_seed(seed)
    t = time.time()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    log(f"  {shape}: {n / 1e9:.2f} B parameters initialized in {time.time() - t:.0f} s (seed {seed})")
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tmp.rename(folder)


# convert_hf_to_gguf.py run as is, after one change to transformers >= 5: it loads every qwen2
# folder's tokenizer as Qwen2Tokenizer (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which replaces
# tokenizer.json's pre-tokenizer with Qwen2's regex; the converter then hashes a pre-tokenizer
# llama.cpp does not know and stops. Without "qwen2" in that set the tokenizer.json is loaded as
# written, as transformers 4.57.6 (the converter's pinned requirement) loads it.
CONVERT = r"""
import runpy, sys
try:
    from transformers.models.auto import tokenization_auto
    tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen2")
except (ImportError, AttributeError):
    pass
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
runpy.run_path(script, run_name="__main__")
"""


def convert(folder: Path, out: Path, outtype: str) -> None:
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ, PYTHONPATH=str(LLAMA_SRC / "gguf-py"))
    args = [LLAMA_SRC / "convert_hf_to_gguf.py", folder, "--outfile", tmp, "--outtype", outtype]
    run([sys.executable, "-c", CONVERT, *args], env=env,
        label=f"PYTHONPATH={env['PYTHONPATH']} python " + " ".join(map(str, args)))
    tmp.rename(out)


def quantize(src: Path, out: Path, preset: str) -> None:
    tmp = out.with_name(out.name + ".tmp")
    run([LLAMA_BIN / "llama-quantize", src, tmp, preset, str(os.cpu_count() or 1)])
    tmp.rename(out)


CHECK = r"""
import re, sys, time
t = time.time()
from forklm import LLM
llm = LLM(sys.argv[1])
t_load = time.time() - t
out = llm.sample([1, 2, 3, 4, 5, 6, 7, 8], n=8, max_tokens=4, seed=0)
print(f"load {t_load:.1f} s; tokens {[list(s.token_ids) for s in out.samples][:2]}...")
print(out.stats.summary())
print(re.search(r"VmHWM:.*", open("/proc/self/status").read()).group(0))
"""


def check(path: Path) -> None:
    """forklm loads and samples the file; llama.cpp's batched bench runs it."""
    run([sys.executable, "-c", CHECK, path], label=f"forklm: LLM({str(path)!r}).sample(8 ids, n=8, max_tokens=4)")
    run([LLAMA_BIN / "llama-batched-bench", "-m", path, "-npp", "64", "-ntg", "4", "-npl", "1", "-t", "2"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="llama-quantize types, comma-separated")
    ap.add_argument("--outtype", choices=("bf16", "f16"), default="bf16", help="the converter's output type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "random-gguf")
    ap.add_argument("--keep", action="store_true", help="keep the HF folder and the BF16/F16 file")
    ap.add_argument("--check", action="store_true", help="load and run each preset file in forklm and llama.cpp")
    ap.add_argument("--no-lock", dest="lock", action="store_false", help=f"do not take {LOCK}")
    args = ap.parse_args()

    shapes = [s for s in args.shapes.split(",") if s]
    presets = [p for p in args.presets.split(",") if p]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    for tool in (LLAMA_SRC / "convert_hf_to_gguf.py", LLAMA_BIN / "llama-quantize"):
        if not tool.exists():
            sys.exit(f"{tool}: missing; run scripts/build_llama_cpp.sh first")
    args.out.mkdir(parents=True, exist_ok=True)

    for shape in shapes:
        folder = args.out / f"{shape}-hf"
        full = args.out / f"{shape}-{args.outtype.upper()}.gguf"
        outs = {p: args.out / f"{shape}-{p}.gguf" for p in presets}
        todo = [p for p, f in outs.items() if not f.exists()]
        if todo or args.keep:
            if not full.exists():
                if not folder.exists():
                    with bench_lock(args.lock):
                        write_hf_folder(shape, folder, args.seed)
                with bench_lock(args.lock):
                    convert(folder, full, args.outtype)
            for p in todo:
                with bench_lock(args.lock):
                    quantize(full, outs[p], p)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
            full.unlink(missing_ok=True)
        for f in ([folder, full] if args.keep else []) + list(outs.values()):
            print(f)
        if args.check:
            for f in outs.values():
                with bench_lock(args.lock):
                    check(f)


if __name__ == "__main__":
    main()
