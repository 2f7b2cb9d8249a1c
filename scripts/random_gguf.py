"""GGUF files of real 1-3B model shapes with random weights, made the way users' files are made.

    .venv/bin/python scripts/random_gguf.py [--shapes llama3.2-1b,qwen2.5-1.5b] [--presets Q4_K_M,Q8_0]
        [--outtype bf16|f16] [--seed 0] [--keep] [--check] [--out .cache/random-gguf] [--no-lock]
    .venv/bin/python scripts/random_gguf.py --direct [--shapes llama3-8b] [--seed 0] [--check]
        [--measure bench/results/NAME.json [--reps 3]]

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
   back to the byte-level BPE path (`sentencepiece`, in forklm's `bench` extra). Under
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

--direct (shapes of DIRECT_SHAPES: llama3-8b, the Llama-3.1-8B configuration): the Q4_K_M file
written directly with gguf's GGUFWriter, no transformers / converter / llama-quantize (for 8B those
need ~16 GB of bf16 weights in RAM, ~40 GB of disk and a long quantization): the metadata and
tokenizer keys the pipeline above gives, each tensor in the type llama-quantize's Q4_K_M gives it,
random blocks whose float16 scales make the weights' std ~0.02, norms 1 (see write_direct).
-> <out>/llama3-8b-Q4_K_M.gguf (4.9 GB; 25 s of writing, 50 s with the check, peak RSS 0.9 GB on
2 cores); a few tensors are then dequantized (gguf.quants) and checked finite with std ~0.02, and
the keys and the tokenizer compared with llama3.2-1b-Q4_K_M.gguf's where that file exists.

--measure JSON (one file): holding the lock, forklm (a fresh process: import torch + forklm = the
baseline RSS, `LLM(path)` timed, then `sample(16-token prompt, n=8, max_tokens=8, seed=0)`, peak
RSS) and llama.cpp (`llama-batched-bench -c 512 -b 512 -ub 512 -npp 16 -ntg 8 -npl 8 -t 2 -pps`,
its peak RSS and `load time`; once more with `-lm none`, no memory-mapped file), in turn, --reps
times each, after one read of the file into the page cache and one short forklm run on a small
file (so no kernel compile falls inside the timed load); the numbers, each process's RSS split
(anonymous / file-backed, polled), the CPU, the commands and the git state go to JSON.

Needs: torch, transformers, safetensors, tokenizers in the venv; llama.cpp built by
scripts/build_llama_cpp.sh (LLAMA_CPP_PYTHON_VERSION / FORKLM_LLAMA_CPP_DIR as there).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
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
    # DeepSeek-V2-Lite's published config (width, MLA attention, experts' shape, top-6 of routed experts
    # + 2 shared, vocabulary, YaRN) with 4 layers (the first dense) and 16 routed experts instead of 27 /
    # 64, and a q LoRA of rank 1536 (DeepSeek-V2's and V3's; llama.cpp loads a q-LoRA-less deepseek2
    # file only with a Lite's layer count): 1.0 B parameters
    "deepseek-v2-lite-4l16e": {
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 16, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "rope_theta": 10000.0, "hidden_act": "silu", "initializer_range": 0.02,
    },
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


# ---------------------------------------------------------------------------------------------------------
# --direct: a Q4_K_M file written block by block (no transformers, no converter, no llama-quantize)
#
# An 8B shape through the pipeline above needs ~16 GB of bf16 weights in RAM, ~40 GB of disk and a long
# quantization on 2 cores. --direct writes the file llama-quantize's Q4_K_M would give directly: the
# metadata keys of a converted Llama file (those of the 1-3B files above, the shape's own values), the
# tokenizer keys the converter writes (forklm's default model's vocabulary padded with "[PAD<id>]"
# tokens of type UNUSED to the shape's vocab_size), llama3 rope factors (rope_freqs.weight, as the
# converter computes them) and each tensor in the type Q4_K_M gives it (llama-quant.cpp,
# llama_tensor_get_type; checked against llama3.2-1b-Q4_K_M.gguf made above):
#   output.weight Q6_K (token_embd.weight too where the embedding is tied: it is then the output);
#   token_embd.weight Q4_K (untied);
#   attn_v / ffn_down: Q6_K on the layers use_more_bits(i, n) picks, else Q4_K;
#   the other matrices Q4_K; norms (and rope_freqs) F32.
# The blocks are random bytes (numpy Generator seeded with [seed, tensor index], written in ~32 MiB
# chunks: the writer's memory stays small) with the float16 block scales set so that the weights have
# mean ~0 and std ~0.02 (transformers' init); norms are 1.
# ---------------------------------------------------------------------------------------------------------

DIRECT_SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B's config.json (Llama-3-8B: the same shape, context 8192, no rope_scaling)
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "initializer_range": 0.02,
    },
}
DIRECT_PRESET = "Q4_K_M"
WEIGHT_STD = 0.02

# Block scales for random bytes. Q4_K (block_q4_K, 144 bytes / 256 weights): d, dmin (f16), 12 bytes
# packing 8 six-bit scales sc and 8 six-bit mins m, 128 bytes of 4-bit q; w = d*sc*q - dmin*m. Random
# bytes make sc, m uniform on 0..63 and q on 0..15, independent; with dmin = 7.5 d the mean is 0 and
# Var(w/d) = E[sc^2]E[q^2] - (E[sc]E[q])^2 + 7.5^2 Var(m) = 1333.5*77.5 - 236.25^2 + 56.25*341.25.
_Q4K_UNIT = (1333.5 * 77.5 - 236.25 ** 2 + 56.25 * 341.25) ** 0.5  # 258.3
# Q6_K (block_q6_K, 210 bytes / 256): 128 bytes ql + 64 bytes qh (6-bit q), 16 int8 scales s, d (f16);
# w = d*s*(q - 32), s uniform on -128..127, q on 0..63: Var(w/d) = E[s^2]E[(q-32)^2] - (E[s]E[q-32])^2.
_Q6K_UNIT = (5461.5 * 341.5 - 0.25 ** 2) ** 0.5  # 1365.7 (d = 1.46e-5: a float16 subnormal, as real Q6_K d often is)


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's rule for the layers whose attn_v / ffn_down get more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def direct_tensors(hp: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows, columns), type name) of every tensor, in a converted file's order."""
    H, F, V, L = hp["hidden_size"], hp["intermediate_size"], hp["vocab_size"], hp["num_hidden_layers"]
    hd = hp.get("head_dim") or H // hp["num_attention_heads"]
    q, kv = hp["num_attention_heads"] * hd, hp["num_key_value_heads"] * hd
    tied = hp.get("tie_word_embeddings", False)
    out: list[tuple[str, tuple[int, ...], str]] = []
    if not tied:
        out.append(("output.weight", (V, H), "Q6_K"))
    out.append(("output_norm.weight", (H,), "F32"))
    if (hp.get("rope_scaling") or {}).get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", (hd // 2,), "F32"))
    out.append(("token_embd.weight", (V, H), "Q6_K" if tied else "Q4_K"))
    for i in range(L):
        more = "Q6_K" if use_more_bits(i, L) else "Q4_K"
        out += [(f"blk.{i}.attn_k.weight", (kv, H), "Q4_K"), (f"blk.{i}.attn_norm.weight", (H,), "F32"),
                (f"blk.{i}.attn_output.weight", (H, q), "Q4_K"), (f"blk.{i}.attn_q.weight", (q, H), "Q4_K"),
                (f"blk.{i}.attn_v.weight", (kv, H), more), (f"blk.{i}.ffn_down.weight", (H, F), more),
                (f"blk.{i}.ffn_gate.weight", (F, H), "Q4_K"), (f"blk.{i}.ffn_norm.weight", (H,), "F32"),
                (f"blk.{i}.ffn_up.weight", (F, H), "Q4_K")]
    return out


def llama3_rope_factors(hp: dict[str, Any]) -> list[float]:
    """rope_freqs.weight as convert_hf_to_gguf.py computes it (conversion/llama.py, generate_extra_tensors:
    torch float32 arithmetic, here in numpy float32)."""
    import math

    import numpy as np

    f32 = np.float32
    rs = hp["rope_scaling"]
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    freqs = f32(1.0) / (f32(hp["rope_theta"]) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    factors = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
            factors.append(float(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth)))
    return factors


def direct_metadata(writer: Any, shape: str, hp: dict[str, Any]) -> None:
    """The keys of a converted + quantized Llama file (those of llama3.2-1b-Q4_K_M.gguf), this shape's values."""
    import gguf

    sys.path.insert(0, str(REPO))
    from forklm.models.registry import DEFAULT_MODEL, packaged_gguf

    hd = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    base, size = shape.rsplit("-", 1)
    writer.add_type("model")
    writer.add_name(f"{base.capitalize()} {size} Random")
    writer.add_finetune("random")
    writer.add_basename(base)
    writer.add_size_label(size.upper())
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(hp["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(hd)
    # tokenizer: forklm's default model's, as the converter writes it from the HF folder (write_tokenizer)
    src = gguf.GGUFReader(packaged_gguf(DEFAULT_MODEL))
    f = {k: v for k, v in src.fields.items() if k.startswith("tokenizer.")}
    tokens, types = list(f["tokenizer.ggml.tokens"].contents()), list(f["tokenizer.ggml.token_type"].contents())
    pad = range(len(tokens), hp["vocab_size"])  # get_vocab_base: the embedding's rows beyond the vocabulary
    tokens += [f"[PAD{i}]" for i in pad]
    types += [int(gguf.TokenType.UNUSED)] * len(pad)
    writer.add_tokenizer_model(f["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(f["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(f["tokenizer.ggml.merges"].contents()))
    for key in ("bos", "eos", "unknown", "padding"):
        if (field := f.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", int(field.contents()))
    writer.add_add_bos_token(bool(f["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in f else False)
    writer.add_add_eos_token(bool(f["tokenizer.ggml.add_eos_token"].contents()) if "tokenizer.ggml.add_eos_token" in f else False)
    if (tmpl := f.get("tokenizer.chat_template")) is not None:
        writer.add_chat_template(tmpl.contents())
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))


def random_blocks(rng: Any, qtype: str, n_blocks: int, std: float = WEIGHT_STD) -> Any:
    """n_blocks random blocks of a K-quant type, (n_blocks, block bytes) uint8, weights of mean ~0 and std ~`std`."""
    import numpy as np

    size = 144 if qtype == "Q4_K" else 210
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == "Q4_K":
        d = np.float16(std / _Q4K_UNIT)
        scales = np.array([d, np.float16(7.5 * float(d))], dtype="<f2").view(np.uint8)  # d, dmin
        blocks[:, 0:4] = scales
    elif qtype == "Q6_K":
        blocks[:, 208:210] = np.array([std / _Q6K_UNIT], dtype="<f2").view(np.uint8)
    else:
        raise ValueError(qtype)
    return blocks


def write_direct(shape: str, out: Path, seed: int) -> None:
    """DIRECT_SHAPES[shape] as a Q4_K_M file of random blocks, written to a temporary name and renamed."""
    import gguf
    import numpy as np

    hp = DIRECT_SHAPES[shape]
    plan = direct_tensors(hp)
    qt = {"Q4_K": gguf.GGMLQuantizationType.Q4_K, "Q6_K": gguf.GGMLQuantizationType.Q6_K}
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    direct_metadata(writer, shape, hp)
    nbytes = {}
    for name, shp, t in plan:
        if t == "F32":
            nbytes[name] = 4 * shp[0]
            writer.add_tensor_info(name, shp, np.dtype(np.float32), nbytes[name])
        else:
            block, size = gguf.GGML_QUANT_SIZES[qt[t]]
            assert shp[-1] % block == 0, (name, shp)
            nbytes[name] = shp[0] * shp[1] // block * size
            # element shape, not byte shape: with a float dtype add_tensor_info keeps it as given
            writer.add_tensor_info(name, shp, np.dtype(np.float32), nbytes[name], raw_dtype=qt[t])
    total = sum(nbytes.values())
    log(f"+ writing {tmp} ({len(plan)} tensors, {total / 2**30:.2f} GiB of tensor data, seed {seed})")
    t0 = time.time()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    rope = np.array(llama3_rope_factors(hp), dtype=np.float32) if any(n == "rope_freqs.weight" for n, _, _ in plan) else None
    done = 0
    for index, (name, shp, t) in enumerate(plan):
        writer.write_padding(fout, fout.tell())  # each tensor's data starts aligned (offsets: write_ti_data_to_file)
        if t == "F32":
            data = rope if name == "rope_freqs.weight" else np.ones(shp, dtype=np.float32)
            assert data.nbytes == nbytes[name]
            data.tofile(fout)
        else:
            rng = np.random.default_rng([seed, index])
            block, size = gguf.GGML_QUANT_SIZES[qt[t]]
            n_blocks = nbytes[name] // size
            step = max(1, (32 << 20) // size)
            for start in range(0, n_blocks, step):
                random_blocks(rng, t, min(step, n_blocks - start)).tofile(fout)
        writer.write_padding(fout, nbytes[name])
        done += nbytes[name]
        if name.endswith("ffn_up.weight") or index == len(plan) - 1:
            log(f"  {name}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB, {time.time() - t0:.0f} s")
    writer.close()
    tmp.rename(out)
    log(f"  ({time.time() - t0:.0f} s, {out.stat().st_size / 1e9:.2f} GB)")


def verify_direct(path: Path, reference: Path | None = None) -> dict[str, Any]:
    """Dequantizes a few tensors' first rows (gguf.quants): finite, std near WEIGHT_STD; norms 1. Compares
    the metadata keys and tensor types with a converted file of the same family when one is given."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(path)
    by = {t.name: t for t in r.tensors}
    names = ["token_embd.weight", "output.weight", "blk.0.attn_v.weight", "blk.4.attn_v.weight",
             "blk.0.ffn_down.weight", "blk.31.ffn_down.weight", "blk.15.attn_q.weight", "blk.15.ffn_gate.weight",
             "output_norm.weight", "blk.7.ffn_norm.weight", "rope_freqs.weight"]
    report: dict[str, Any] = {}
    for name in names:
        if name not in by:
            continue
        t = by[name]
        raw = np.asarray(t.data)
        rows = raw[:64] if raw.ndim == 2 else raw
        w = gguf.quants.dequantize(rows, t.tensor_type) if t.tensor_type not in (gguf.GGMLQuantizationType.F32,) else rows
        w = np.asarray(w, dtype=np.float64)
        report[name] = {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape], "finite": bool(np.isfinite(w).all()),
                        "mean": float(w.mean()), "std": float(w.std()), "min": float(w.min()), "max": float(w.max())}
        log(f"  {name:24s} {t.tensor_type.name:5s} finite={report[name]['finite']} mean={w.mean():+.5f} "
            f"std={w.std():.5f} range=[{w.min():+.4f}, {w.max():+.4f}]")
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    log(f"  tensor types: {counts}")
    if reference is not None and reference.exists():
        ref = gguf.GGUFReader(reference)
        mine, theirs = set(r.fields), set(ref.fields)
        log(f"  keys vs {reference.name}: missing {sorted(theirs - mine)}, extra {sorted(mine - theirs)}")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            same = r.fields[key].contents() == ref.fields[key].contents()
            log(f"  {key}: {'identical' if same else 'DIFFERENT'} to {reference.name}'s")
    return report


# ---------------------------------------------------------------------------------------------------------
# --measure JSON: forklm against llama.cpp on one file: load time and peak RSS, n = 8 samples
# ---------------------------------------------------------------------------------------------------------

MEASURE_PROMPT = "Once upon a time, in a small village by the sea, there lived an"  # 16 tokens (SmolLM2's vocabulary)
MEASURE_N, MEASURE_TOKENS = 8, 8

# A fresh process: imports torch and forklm (its peak RSS then: the baseline), times LLM(path), samples
# n = 8 x 8 tokens of the prompt; prints a "stage:" line with /proc/self/status's memory figures after
# each step (so a process killed midway still tells how far it got and where its memory was), then a
# "result:" line.
MEASURE_FORKLM = r"""
import json, resource, sys, time, warnings
T0 = time.perf_counter()
caught = []
def _show(message, category, filename, lineno, file=None, line=None):
    caught.append(f"{category.__name__}: {message}")
    print(f"warning: {category.__name__}: {message}", file=sys.stderr, flush=True)
warnings.showwarning = _show
warnings.simplefilter("always")
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key + "_mib"] = int(value.split()[0]) / 1024
    return out
def stage(name, **extra):
    print("stage: " + json.dumps({"stage": name, "t_s": time.perf_counter() - T0, **status(), **extra}), flush=True)
stage("started")
import torch
import forklm
from forklm import LLM
baseline = status()
stage("imported", torch=torch.__version__, forklm=forklm.__version__, torch_threads=torch.get_num_threads())
path, prompt, n, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
llm = LLM(path)
load_s = time.perf_counter() - t
stage("loaded", load_s=load_s)
ids = llm.prompt_token_ids(prompt)
t = time.perf_counter()
out = llm.sample(prompt, n=n, max_tokens=max_tokens, seed=0)
sample_s = time.perf_counter() - t
stage("sampled", sample_s=sample_s)
end = status()
print("result: " + json.dumps({
    "load_s": load_s, "sample_s": sample_s,
    "baseline_rss_mib": baseline["VmHWM_mib"],
    "loaded_rss_mib": None,
    "peak_rss_mib": end["VmHWM_mib"],
    "peak_rss_mib_getrusage": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "end_rss": end,
    "prompt_tokens": len(ids), "prompt_ids": ids,
    "samples": [{"text": s.text, "token_ids": list(s.token_ids), "finish_reason": s.finish_reason} for s in out.samples],
    "stats": out.stats.summary(),
    "dtype": str(llm.dtype).removeprefix("torch."), "quantize": llm.quantize,
    "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "forklm": forklm.__version__,
    "warnings": caught,
}), flush=True)
"""


def _proc_status_lines(text: str, tag: str) -> list[dict]:
    return [json.loads(line[len(tag):]) for line in text.splitlines() if line.startswith(tag)]


def cpu_info() -> dict[str, Any]:
    info = {"model_name": None, "flags_avx": [], "cores": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and info["model_name"] is None:
                info["model_name"] = value.strip()
            if key.strip() == "flags":
                flags = value.split()
                info["flags_avx"] = sorted(f for f in flags if f == "avx2" or f.startswith("avx512") or f in ("fma", "f16c"))
                break
        info["avx2"] = "avx2" in info["flags_avx"]
        info["avx512"] = any(f.startswith("avx512") for f in info["flags_avx"])
        mem = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines())}
        info["mem_total"] = mem.get("MemTotal")
    except OSError:
        pass
    return info


def mem_available_mib() -> float | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return None


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "uncommitted": git("status", "--short", "--untracked-files=no").splitlines()}


def warm_page_cache(path: Path) -> float:
    """Reads the file once (both engines then load it from the page cache); seconds taken."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            kids = []
        out += kids
        todo += kids
    return out


def _memory(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key + "_mib"] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    return out


def run_polled(args: list[str], **kw: Any) -> tuple[subprocess.CompletedProcess, float | None, float, dict]:
    """`args` under bench/llama_cpp.py's rusage helper (its ru_maxrss: the figure /usr/bin/time -v prints), its
    process tree's /proc status read every 0.1 s: (done, peak RSS MiB, wall s, the anonymous / file-backed split
    at the largest RSS seen and the largest of each). File-backed pages (a memory-mapped model) count in RSS."""
    sys.path.insert(0, str(REPO))
    from bench.llama_cpp import measured_command, parse_report

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        report = Path(tmp) / "rusage"
        t = time.perf_counter()
        proc = subprocess.Popen(measured_command(args, report), stdout=out, stderr=err, text=True, errors="replace", **kw)
        split: dict[str, Any] = {"at_max_rss": {}, "max_RssAnon_mib": 0.0, "max_RssFile_mib": 0.0}
        while proc.poll() is None:
            for pid in _descendants(proc.pid):
                m = _memory(pid)
                if m.get("VmRSS_mib", 0) > split["at_max_rss"].get("VmRSS_mib", 0):
                    split["at_max_rss"] = m
                for key in ("RssAnon_mib", "RssFile_mib"):
                    split["max_" + key] = max(split["max_" + key], m.get(key, 0.0))
            time.sleep(0.1)
        wall = time.perf_counter() - t
        maxrss = parse_report(report.read_text())[0] if report.is_file() else None
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
    return done, maxrss, wall, split


def run_forklm(path: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from bench import child_env

    args = [sys.executable, "-c", MEASURE_FORKLM, str(path), MEASURE_PROMPT, str(MEASURE_N), str(MEASURE_TOKENS)]
    done, maxrss, wall, split = run_polled(args, cwd=REPO, env=child_env())
    stages = _proc_status_lines(done.stdout, "stage: ")
    results = _proc_status_lines(done.stdout, "result: ")
    out: dict[str, Any] = results[-1] if results else {"error": f"exited {done.returncode} after stage "
                                                                f"{stages[-1]['stage'] if stages else None!r}"}
    loaded = [s for s in stages if s["stage"] == "loaded"]
    if results and loaded:
        out["loaded_rss_mib"] = loaded[0]["VmRSS_mib"]
    out.update(returncode=done.returncode, wall_s=wall, peak_rss_mib_wait4=maxrss, rss_split_polled=split,
               stages=stages, stderr_tail=done.stderr.strip().splitlines()[-20:])
    return out


def llama_cpp_command(path: Path, load_mode: str | None = None) -> list[str]:
    return [str(LLAMA_BIN / "llama-batched-bench"), "-m", str(path), "-c", "512", "-b", "512", "-ub", "512",
            "-npp", "16", "-ntg", str(MEASURE_TOKENS), "-npl", str(MEASURE_N), "-t", "2", "-pps",
            *(["-lm", load_mode] if load_mode else []),
            "--output-format", "jsonl", "-lv", "4"]  # -lv 4: the info lines with the load time (bench/llama_cpp.py)


_BUFFER = re.compile(r"(\S+) (model|KV|compute|output) buffer size\s*=\s*([0-9.]+) MiB")


def run_llama_cpp(path: Path, load_mode: str | None = None) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from bench.llama_cpp import parse_jsonl, parse_load_time_s, parse_ready_s

    done, maxrss, wall, split = run_polled(llama_cpp_command(path, load_mode))
    rows = parse_jsonl(done.stdout)
    warn = [line for line in done.stderr.splitlines() if " W " in line]
    buffers = [f"{m.group(1)} {m.group(2)} {m.group(3)} MiB" for m in _BUFFER.finditer(done.stderr)]
    return {"load_mode": load_mode or "default (mmap)", "load_s": parse_load_time_s(done.stderr),
            "ready_s": parse_ready_s(done.stderr), "peak_rss_mib": maxrss, "wall_s": wall,
            "returncode": done.returncode, "rss_split_polled": split, "buffers": buffers, "rows": rows,
            "warnings": warn[:20], "stderr_tail": done.stderr.strip().splitlines()[-12:] if done.returncode else []}


def measure(path: Path, out_json: Path, reps: int, lock: bool) -> None:
    """forklm and llama.cpp on `path`, alternating, `reps` times each, holding the bench lock throughout."""
    import datetime
    import statistics

    result: dict[str, Any] = {
        "what": ("an 8B-shape (Llama-3.1-8B configuration) Q4_K_M GGUF file of random blocks, written by "
                 "scripts/random_gguf.py --direct: loads and samples n = 8 in forklm; load time and peak RSS "
                 "against llama.cpp on the same file"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "file": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
        "file_bytes": path.stat().st_size, "file_gib": path.stat().st_size / 2**30,
        "cpu": cpu_info(), "git": git_state(),
        "commands": {
            "reproduce": ".venv/bin/python scripts/random_gguf.py --direct --shapes llama3-8b "
                         f"--measure {out_json.relative_to(REPO) if out_json.is_relative_to(REPO) else out_json}",
            "forklm": (f"python -c MEASURE_FORKLM (scripts/random_gguf.py) FILE: LLM(FILE) timed, then "
                       f"llm.sample({MEASURE_PROMPT!r}, n={MEASURE_N}, max_tokens={MEASURE_TOKENS}, seed=0)"),
            "llama.cpp": " ".join(llama_cpp_command(path)).replace(str(REPO) + "/", ""),
            "llama.cpp -lm none": " ".join(llama_cpp_command(path, "none")).replace(str(REPO) + "/", ""),
        },
        "method": {
            "forklm_load_s": "LLM(path) in a fresh process that has imported torch and forklm",
            "forklm_baseline_rss_mib": "VmHWM after `import torch, forklm` (nothing loaded)",
            "forklm_peak_rss_mib": ("VmHWM at the end (after the sample); peak_rss_mib_getrusage is the process's "
                                    "getrusage(RUSAGE_SELF).ru_maxrss, peak_rss_mib_wait4 the same figure taken by "
                                    "bench/llama_cpp.py's small rusage helper (the parent's peak is not carried in)"),
            "llama_cpp_load_s": "llama_perf_context_print 'load time': model load to the end of its 16-token warm-up decode",
            "llama_cpp_ready_s": "log timestamp of 'sched_reserve: reserve took': model loaded and context built, before any decode",
            "llama_cpp_peak_rss_mib": "ru_maxrss of llama-batched-bench via bench/llama_cpp.py's rusage helper (what /usr/bin/time -v prints)",
            "llama_cpp_kv": ("-c 512 with -npl 8 and no -kvu: llama.cpp pads each sequence's share (64 cells) to 256, so its "
                             "KV cache has 2048 cells (its warning 'n_ctx is not divisible by n_seq_max - rounding down to 2048')"),
            "llama.cpp -lm none": ("the same command without memory-mapping the file (-lm none): the weights read into "
                                   "anonymous memory; by default (mmap) the file's pages count in its RSS beside the "
                                   "CPU_REPACK copy of the Q4_K matrices"),
            "rss_split_polled": ("VmRSS / RssAnon / RssFile of the process tree read from /proc every 0.1 s: the anonymous / "
                                 "file-backed split at the largest RSS seen (a lower bound of the true peak)"),
            "page_cache": "the file is read once before the runs, so every run loads it from the page cache",
            "order": f"forklm, llama.cpp, llama.cpp -lm none in turn, {reps} runs each; summary = median",
        },
    }
    with bench_lock(lock):
        result["mem_available_mib_start"] = mem_available_mib()
        result["page_cache_warm_read_s"] = warm_page_cache(path)
        log(f"+ page cache warmed in {result['page_cache_warm_read_s']:.1f} s; MemAvailable {mem_available_mib():.0f} MiB")
        # forklm's C++ kernels build on first use (a hash of their sources names the build): a short run on a small
        # file of the same types first, so that no compile falls inside the timed load
        small = REPO / ".cache" / "random-gguf" / "llama3.2-1b-Q4_K_M.gguf"
        warm_args = [sys.executable, "-c", "import sys; from forklm import LLM; "
                     "LLM(sys.argv[1] if len(sys.argv) > 1 else 'default').sample('Hello there', n=8, max_tokens=2, seed=0)"]
        if small.exists():
            warm_args.append(str(small))
        t = time.perf_counter()
        sys.path.insert(0, str(REPO))
        from bench import child_env

        w = subprocess.run(warm_args, cwd=REPO, env=child_env(), capture_output=True, text=True)
        result["forklm_kernel_warmup"] = {"file": str(small.relative_to(REPO)) if small.exists() else "default model",
                                          "s": time.perf_counter() - t, "returncode": w.returncode,
                                          "stderr_tail": w.stderr.strip().splitlines()[-5:]}
        log(f"+ forklm warm-up ({result['forklm_kernel_warmup']['file']}): {result['forklm_kernel_warmup']['s']:.0f} s, rc {w.returncode}")
        runs: dict[str, list] = {"forklm": [], "llama.cpp": [], "llama.cpp -lm none": []}
        for rep in range(reps):
            log(f"+ forklm run {rep + 1}/{reps}: LLM({path.name}).sample(n={MEASURE_N}, max_tokens={MEASURE_TOKENS})")
            fk = run_forklm(path)
            runs["forklm"].append(fk)
            log(f"  load {fk.get('load_s')} s, sample {fk.get('sample_s')} s, baseline {fk.get('baseline_rss_mib')} MiB, "
                f"peak {fk.get('peak_rss_mib')} MiB (wait4 {fk.get('peak_rss_mib_wait4')}), rc {fk['returncode']} "
                f"{fk.get('error', '')}")
            for mode, engine in ((None, "llama.cpp"), ("none", "llama.cpp -lm none")):
                log(f"+ {engine} run {rep + 1}/{reps}")
                lc = run_llama_cpp(path, mode)
                runs[engine].append(lc)
                log(f"  load {lc['load_s']} s (ready {lc['ready_s']} s), peak {lc['peak_rss_mib']} MiB, rc {lc['returncode']}; "
                    f"{', '.join(lc['buffers'])}")
        result["mem_available_mib_end"] = mem_available_mib()
    result["git_end"] = git_state()

    def med(engine: str, key: str) -> float | None:
        vals = [r[key] for r in runs[engine] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    summary = {
        "forklm": {k: med("forklm", k) for k in ("load_s", "sample_s", "baseline_rss_mib", "loaded_rss_mib",
                                                 "peak_rss_mib", "peak_rss_mib_getrusage", "peak_rss_mib_wait4")},
        **{e: {k: med(e, k) for k in ("load_s", "ready_s", "peak_rss_mib")} for e in ("llama.cpp", "llama.cpp -lm none")},
    }
    fk, lc = summary["forklm"], summary["llama.cpp"]
    if fk["load_s"] and lc["load_s"]:
        summary["load_ratio_forklm_over_llama_cpp"] = fk["load_s"] / lc["load_s"]
    if fk["peak_rss_mib"] and lc["peak_rss_mib"]:
        summary["peak_rss_ratio_forklm_over_llama_cpp"] = fk["peak_rss_mib"] / lc["peak_rss_mib"]
    result["summary"] = summary
    result["runs"] = runs
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    log(f"+ wrote {out_json}")
    log(json.dumps(summary, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated, of: {', '.join(SHAPES)} (default: all), or with --direct of: "
                         f"{', '.join(DIRECT_SHAPES)} (default: all)")
    ap.add_argument("--presets", default=None,
                    help=f"llama-quantize types, comma-separated (default: {','.join(DEFAULT_PRESETS)}; --direct: {DIRECT_PRESET} only)")
    ap.add_argument("--outtype", choices=("bf16", "f16"), default="bf16", help="the converter's output type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "random-gguf")
    ap.add_argument("--keep", action="store_true", help="keep the HF folder and the BF16/F16 file")
    ap.add_argument("--check", action="store_true", help="load and run each preset file in forklm and llama.cpp")
    ap.add_argument("--direct", action="store_true",
                    help=f"write {DIRECT_PRESET} files of DIRECT_SHAPES block by block (no transformers / converter / quantizer)")
    ap.add_argument("--measure", type=Path, default=None, metavar="JSON",
                    help="forklm vs llama.cpp on the (one) file: load time, peak RSS, n=8 samples; results to JSON")
    ap.add_argument("--reps", type=int, default=3, help="--measure: runs of each engine")
    ap.add_argument("--no-lock", dest="lock", action="store_false", help=f"do not take {LOCK}")
    args = ap.parse_args()

    known = DIRECT_SHAPES if args.direct else SHAPES
    shapes = [s for s in (args.shapes or ",".join(known)).split(",") if s]
    presets = [p for p in (args.presets or (DIRECT_PRESET if args.direct else ",".join(DEFAULT_PRESETS))).split(",") if p]
    for s in shapes:
        if s not in known:
            ap.error(f"unknown shape {s!r} (known{' with --direct' if args.direct else ''}: {', '.join(known)})")
    if args.direct and presets != [DIRECT_PRESET]:
        ap.error(f"--direct writes {DIRECT_PRESET} only")
    if args.measure is not None and len(shapes) * len(presets) != 1:
        ap.error("--measure takes one file: name one shape (and one preset)")
    tools = [LLAMA_BIN / "llama-batched-bench"] if args.check or args.measure else []
    if not args.direct:
        tools += [LLAMA_SRC / "convert_hf_to_gguf.py", LLAMA_BIN / "llama-quantize"]
    for tool in tools:
        if not tool.exists():
            sys.exit(f"{tool}: missing; run scripts/build_llama_cpp.sh first")
    args.out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []

    for shape in shapes:
        if args.direct:
            out = args.out / f"{shape}-{DIRECT_PRESET}.gguf"
            if not out.exists():
                with bench_lock(args.lock):
                    write_direct(shape, out, args.seed)
                log(f"+ checking {out.name}")
                verify_direct(out, reference=args.out / "llama3.2-1b-Q4_K_M.gguf")
            print(out)
            made.append(out)
            if args.check:
                with bench_lock(args.lock):
                    check(out)
            continue
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
        made += list(outs.values())
        if args.check:
            for f in outs.values():
                with bench_lock(args.lock):
                    check(f)

    if args.measure is not None:
        measure(made[0], args.measure.resolve(), args.reps, args.lock)


if __name__ == "__main__":
    main()
