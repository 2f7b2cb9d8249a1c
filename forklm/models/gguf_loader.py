"""Loading a GGUF file (llama.cpp's format): config, dequantized float32 weights under HF names, tokenizer."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forklm.config import ModelConfig, RopeConfig
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.models.gguf_file import GGMLType
from forklm.tokenizer import Tokenizer

_ARCHITECTURES = ("llama", "qwen2", "gpt2", "starcoder", "deepseek2")
_GPT2_FAMILY = {"gpt2": "gpt2", "starcoder": "gpt_bigcode"}  # GGUF architecture -> models/gpt2.py's

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_down.bias": "mlp.down_proj.bias",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# GPT-2 / StarCoder files (llama.cpp's converter writes every matrix [out, in], the head tied)
_GPT2_GLOBAL_NAMES = {
    "token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_GPT2_LAYER_NAMES = {
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# general.file_type values that say what the whole checkpoint is stored in (llama.cpp's LLAMA_FTYPE).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def load_gguf(path: str | Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """Reads a GGUF file into (config, float32 weights under Hugging Face names, tokenizer).

    keep_quantized: every matrix stored in a type forklm runs as stored (quantized blocks, F16, BF16)
    comes back as the file's bytes (`forklm.kernels.ggml_gemm.GGMLWeights`, a view of the memory-
    mapped file; the q/k rope permutation recorded as a row order, not applied) instead of float32;
    1-D tensors and F32 matrices are float32 as before."""
    from forklm.models.gguf_file import read_gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        meta, tensors = read_gguf(path)
    except Exception as e:  # ValueError/struct errors on bad or truncated files
        raise ModelFileError(f"{path}: not a valid GGUF file or truncated ({type(e).__name__}: {e})") from None

    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(_ARCHITECTURES)
        raise UnsupportedModelError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    try:
        tokenizer = Tokenizer.from_gguf_fields(meta)
    except (ModelFileError, UnsupportedModelError) as e:
        raise type(e)(f"{path}: {e}") from None
    infos = {t.name: t for t in tensors}
    if arch == "deepseek2":
        return _load_deepseek(meta, infos, tokenizer, path, keep_quantized)
    gpt2 = arch in _GPT2_FAMILY
    config = _gpt2_config_of(meta, arch, infos, tokenizer, path) if gpt2 else _config_of(meta, arch, infos, tokenizer, path)

    expected = _gpt2_expected_shapes(config) if gpt2 else _expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for name, info in infos.items():
        if name == "rope_freqs.weight":  # folded into config.rope by _config_of
            continue
        hf_name = _hf_name(name, gpt2)
        if hf_name not in expected:
            detail = "" if gpt2 else f" (attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias})"
            raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for this {arch} model{detail}")
        shape = tuple(int(d) for d in reversed(info.shape))  # GGUF lists dims fastest-first (ne order)
        if shape != expected[hf_name]:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {shape}, expected {expected[hf_name]}")
        w = _blocks(info, shape) if keep_quantized else None
        if w is None:
            w = _dequantize(info, path)
        if arch == "llama" and re.search(r"\.attn_[qk]\.", name):
            # llama.cpp's convert script permutes q/k rows so that each head's rotary pairs are adjacent
            # (GGML's rope); HF's rotate_half wants the two halves of a head apart. Undo it. Qwen2 is
            # converted without permuting (llama.cpp runs it with NEOX rope, i.e. the HF layout).
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            if isinstance(w, torch.Tensor):
                w = _unpermute(w, heads)
            else:  # the same permutation recorded: Hugging Face row i is stored row order[i]
                w.row_order = _unpermute(torch.arange(shape[0]), heads)
        weights[hf_name] = w
    del tensors, infos
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{path}: missing tensor for {missing[0]}{more}")
    return config, weights, tokenizer


def _hf_name(name: str, gpt2: bool = False) -> str | None:
    global_names, layer_names, layer = ((_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, "transformer.h") if gpt2
                                        else (_GLOBAL_NAMES, _LAYER_NAMES, "model.layers"))
    if name in global_names:
        return global_names[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m[2] in layer_names:
        return f"{layer}.{int(m[1])}.{layer_names[m[2]]}"
    return None


def _gpt2_config_of(meta: dict[str, Any], arch: str, infos: dict[str, Any], tokenizer: Tokenizer, path: Path):
    """GPT2Config (models/gpt2.py) from a `gpt2` / `starcoder` file's metadata (llama.cpp runs both
    with the tanh GELU, as transformers' gelu_new / gelu_pytorch_tanh)."""
    from forklm.models.gpt2 import GPT2Config

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(f"{path}: missing metadata key {arch}.{key!r}")
        return value

    H, heads = int(get("embedding_length")), int(get("attention.head_count"))
    g = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    if H % heads or heads % g:
        raise ModelFileError(f"{path}: embedding_length {H}, {heads} heads and {g} KV heads do not divide")
    embd = infos.get("token_embd.weight")
    vocab = int(embd.shape[-1]) if embd is not None else len(meta["tokenizer.ggml.tokens"])
    return GPT2Config(
        architecture=_GPT2_FAMILY[arch], vocab_size=vocab, hidden_size=H,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=g, head_dim=H // heads, max_position_embeddings=int(get("context_length")),
        layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)), activation="tanh",
        tie_word_embeddings="output.weight" not in infos, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids, attn_heads_kv=g, attn_head_dim=H // heads, conv1d=False,
    )


def _gpt2_expected_shapes(c) -> dict[str, tuple[int, ...]]:
    H, I, D, g = c.hidden_size, c.intermediate_size, c.attn_head_dim, c.attn_heads_kv
    qkv = H + 2 * g * D
    want = {"transformer.wte.weight": (c.vocab_size, H), "transformer.wpe.weight": (c.max_position_embeddings, H),
            "transformer.ln_f.weight": (H,), "transformer.ln_f.bias": (H,)}
    if not c.tie_word_embeddings:
        want["lm_head.weight"] = (c.vocab_size, H)
    for n in range(c.num_layers):
        p = f"transformer.h.{n}."
        want.update({p + "ln_1.weight": (H,), p + "ln_1.bias": (H,), p + "attn.c_attn.weight": (qkv, H),
                     p + "attn.c_attn.bias": (qkv,), p + "attn.c_proj.weight": (H, H), p + "attn.c_proj.bias": (H,),
                     p + "ln_2.weight": (H,), p + "ln_2.bias": (H,), p + "mlp.c_fc.weight": (I, H),
                     p + "mlp.c_fc.bias": (I,), p + "mlp.c_proj.weight": (H, I), p + "mlp.c_proj.bias": (H,)})
    return want


def _dequantize(info: Any, path: Path) -> torch.Tensor:
    kind = info.tensor_type
    shape = tuple(int(d) for d in reversed(info.shape))
    try:
        if kind == GGMLType.F32:
            arr = np.array(info.data, dtype=np.float32)  # copy out of the memory-mapped file
        elif kind == GGMLType.F64:
            arr = info.data.astype(np.float32)
        else:  # the gguf package's numpy dequantization (imported only here: it costs a tenth of a load)
            import gguf

            arr = gguf.quants.dequantize(info.data, gguf.GGMLQuantizationType(int(kind)))
        return torch.from_numpy(np.ascontiguousarray(arr.reshape(shape), dtype=np.float32))
    except NotImplementedError:
        raise UnsupportedModelError(f"{path}: tensor {info.name!r} has unsupported type {kind.name}") from None
    except ValueError as e:
        raise ModelFileError(f"{path}: tensor {info.name!r} cannot be read ({e})") from None


def _blocks(info: Any, shape: tuple[int, ...]) -> Any:
    """A matrix of a type forklm runs as stored, as the file's bytes (GGMLWeights over the memory-
    mapped file, no copy), or None (1-D tensors, F32 and F64 matrices: read as float32). A type
    forklm has no kernel for is refused by name when the model places it (quant.stored_matrix)."""
    import warnings

    from forklm.kernels.ggml_gemm import GGMLWeights

    kind = info.tensor_type.name
    if len(shape) != 2 or kind in ("F32", "F64"):
        return None
    raw = np.asarray(info.data).view(np.uint8).reshape(shape[0], -1)
    with warnings.catch_warnings():  # the file is mapped read-only; forklm never writes to weights
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(raw)
    return GGMLWeights(data, kind, shape[0], shape[1], mapped=True)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute(): rows (head, 2, d/2) were stored as (head, d/2, 2)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config_of(meta: dict[str, Any], arch: str, infos: dict[str, Any], tokenizer: Tokenizer,
               path: Path) -> ModelConfig:
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise ModelFileError(f"{path}: missing metadata key {arch}.{key!r}")
        return value

    hidden = int(get("embedding_length", required=True))
    num_heads = int(get("attention.head_count", required=True))
    num_kv = get("attention.head_count_kv") or num_heads
    if isinstance(num_kv, list):  # per-layer counts (hybrid models)
        raise UnsupportedModelError(f"{path}: per-layer KV head counts are not supported")
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads)
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial rotary embeddings ({rope_dim} of {head_dim} dims) are not supported")
    num_layers = int(get("block_count", required=True))
    embd = infos.get("token_embd.weight")
    vocab = int(get("vocab_size") or (embd.shape[-1] if embd is not None else len(meta["tokenizer.ggml.tokens"])))
    theta = float(get("rope.freq_base", 10000.0))
    ctx = int(get("context_length", 2048))

    if "rope_freqs.weight" in infos:
        rope = _llama3_rope(_dequantize(infos["rope_freqs.weight"], path), theta, head_dim,
                            get("rope.scaling.original_context_length"), path)
    else:
        kind = get("rope.scaling.type", "none")
        factor = float(get("rope.scaling.factor") or get("rope.scale_linear") or 1.0)
        if kind == "linear" or (kind == "none" and factor != 1.0):
            rope = RopeConfig(theta=theta, rope_type="linear", factor=factor)
        elif kind == "none":
            rope = RopeConfig(theta=theta)
        else:
            raise UnsupportedModelError(f"{path}: unsupported rope scaling type {kind!r} (supported: none, linear)")

    try:
        return ModelConfig(
            architecture=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)), num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=int(num_kv), head_dim=head_dim, max_position_embeddings=ctx,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), rope=rope,
            tie_word_embeddings="output.weight" not in infos,  # llama.cpp omits output.weight when tied
            # biases as the file has them; _expected_shapes then refuses any it has that the model cannot use
            attention_bias="blk.0.attn_q.bias" in infos, mlp_bias=arch == "llama" and "blk.0.ffn_up.bias" in infos,
            dtype=_FILE_DTYPES.get(meta.get("general.file_type")),
            bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
        )
    except ModelFileError as e:  # e.g. head counts that do not divide
        raise ModelFileError(f"{path}: {e}") from None


def _llama3_rope(factors: torch.Tensor, theta: float, head_dim: int, original: Any, path: Path) -> RopeConfig:
    """Recovers Llama-3 rope scaling from llama.cpp's `rope_freqs.weight` (one divisor per frequency).

    llama.cpp writes the scaling as this tensor, not as metadata (transformers' GGUF loader drops it,
    so it runs Llama-3.1 GGUFs without scaling). Per frequency with wavelength w the divisor is 1 for
    w < orig/high, `factor` for w > orig/low, and 1/((1-s)/factor + s) between, with
    s = (orig/w - low)/(high - low). Only orig/low and orig/high are fixed by the tensor; we take orig
    from metadata (default 8192, as Llama 3.1) and solve for low and high."""
    f = factors.double()
    n = f.numel()
    if n != head_dim // 2:
        raise ModelFileError(f"{path}: rope_freqs.weight has {n} entries, expected {head_dim // 2}")
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:  # all ones: no scaling
        return RopeConfig(theta=theta)
    orig = int(original or 8192)
    inv_wavelen = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim) / (2 * math.pi)
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if int(mid.sum()) >= 2:  # s is linear in 1/w: s = orig/(high-low) * (1/w) - low/(high-low)
        s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        x = inv_wavelen[mid]
        slope = float(((x - x.mean()) * (s - s.mean())).sum() / ((x - x.mean()) ** 2).sum())
        width = orig / slope
        low = round(-(float(s.mean()) - slope * float(x.mean())) * width, 4)
        high = round(low + width, 4)
    else:
        low, high = 1.0, 4.0
    rope = RopeConfig(theta=theta, rope_type="llama3", factor=round(factor, 4), low_freq_factor=low,
                      high_freq_factor=high, original_max_position_embeddings=orig)
    # Check the recovered parameters reproduce the tensor.
    s = ((orig * inv_wavelen - low) / (high - low)).clamp(0, 1)
    expect = 1 / ((1 - s) / rope.factor + s)
    if not torch.allclose(expect, f, rtol=1e-3):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight does not follow Llama-3 rope scaling")
    return rope


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, with its HF shape ([out_features, in_features])."""
    q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    want = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        want["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        want.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                     p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                     p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                     p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                     p + "post_attention_layernorm.weight": (h,)})
        if c.attention_bias:
            want.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                         p + "self_attn.v_proj.bias": (kv,)})
        if c.o_proj_bias:
            want[p + "self_attn.o_proj.bias"] = (h,)
        if c.mlp_bias:
            want.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)})
    return want


# DeepSeek-V2 / V3 files (llama.cpp's `deepseek2`): HF names of the per-layer tensors; the experts
# (ffn_*_exps, [E, rows, k]) split per expert, attn_k_b / attn_v_b joined back into kv_b_proj.
_DEEPSEEK_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_DEEPSEEK_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                     "ffn_down_exps.weight": "down_proj"}
# read as float32 whatever their type: routing and the absorbed decode's W_UK / W_UV run in float32
_DEEPSEEK_FLOAT = ("ffn_gate_inp.weight", "exp_probs_b.bias", "attn_kv_b.weight", "attn_k_b.weight",
                   "attn_v_b.weight")


def _load_deepseek(meta: dict[str, Any], infos: dict[str, Any], tokenizer: Tokenizer, path: Path,
                   keep_quantized: bool):
    """(DeepseekConfig, weights under Hugging Face names, tokenizer) of a `deepseek2` file: each routed
    expert's matrices are row ranges of the file's stacked [E, rows, k] tensors (views of the mapped
    file, kept as stored where keep_quantized), the multi-token-prediction layers skipped."""
    from forklm.models.deepseek import DeepseekConfig

    try:
        config = DeepseekConfig.from_gguf_fields(meta, infos, tokenizer)
        config = dataclasses.replace(config, dtype=_FILE_DTYPES.get(meta.get("general.file_type")))
    except (ModelFileError, UnsupportedModelError) as e:
        raise type(e)(f"{path}: {e}") from None
    expected = _deepseek_expected_shapes(config, "blk.0.attn_kv_b.weight" in infos)
    weights: dict[str, Any] = {}
    seen: set[str] = set()
    for name, info in infos.items():
        shape = tuple(int(d) for d in reversed(info.shape))
        m = _LAYER_RE.fullmatch(name)
        if m and int(m[1]) >= config.num_layers:
            continue  # multi-token prediction (nextn) layers: plain decoding does not run them
        if m and m[2] in ("attn_k_b.weight", "attn_v_b.weight"):
            hf_name = f"model.layers.{int(m[1])}.self_attn.{m[2][5]}_b"
        elif m and m[2] in _DEEPSEEK_EXPERTS:
            hf_name = f"model.layers.{int(m[1])}.mlp.experts.{_DEEPSEEK_EXPERTS[m[2]]}"
        elif m and m[2] in _DEEPSEEK_LAYER_NAMES:
            hf_name = f"model.layers.{int(m[1])}.{_DEEPSEEK_LAYER_NAMES[m[2]]}"
        else:
            hf_name = _GLOBAL_NAMES.get(name)
        if hf_name not in expected:
            raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for this deepseek2 model "
                                        f"(q_lora_rank={config.q_lora_rank}, scoring {config.scoring_func}, "
                                        f"{config.first_k_dense_replace} dense layers)")
        if shape != expected[hf_name]:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {shape}, expected {expected[hf_name]}")
        seen.add(hf_name)
        as_float = not keep_quantized or (m is not None and m[2] in _DEEPSEEK_FLOAT)
        if m and m[2] in _DEEPSEEK_EXPERTS:  # [E, rows, k] -> E matrices [rows, k], row ranges of one view
            E, rows, k = shape
            flat = dataclasses.replace(info, shape=(k, E * rows), data=info.data.reshape(E * rows, -1))
            w = None if as_float else _blocks(flat, (E * rows, k))
            w = _dequantize(flat, path) if w is None else w
            pre = hf_name[: -len(_DEEPSEEK_EXPERTS[m[2]])]
            for e in range(E):
                part = w[e * rows : (e + 1) * rows] if isinstance(w, torch.Tensor) else w.row_range(e * rows, (e + 1) * rows)
                weights[f"{pre}{e}.{_DEEPSEEK_EXPERTS[m[2]]}.weight"] = part
            continue
        w = None if as_float else _blocks(info, shape)
        weights[hf_name] = _dequantize(info, path) if w is None else w
    optional = {n for n in expected if n.endswith("e_score_correction_bias")}  # llama.cpp: no bias, none added
    missing = [n for n in expected if n not in seen and n not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{path}: missing tensor for {missing[0]}{more}")
    for name in optional - seen:
        weights[name] = torch.zeros(config.n_routed_experts)
    for i in range(config.num_layers):  # W_UK [h, r, dn] and W_UV [h, dv, r] joined back into kv_b_proj
        pre = f"model.layers.{i}.self_attn."
        if pre + "k_b" in weights:
            kb, vb = weights.pop(pre + "k_b"), weights.pop(pre + "v_b")
            weights[pre + "kv_b_proj.weight"] = torch.cat([kb.transpose(1, 2), vb], dim=1).reshape(-1, kb.shape[1])
    return config, weights, tokenizer


def _deepseek_expected_shapes(c, kv_b_joined: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a deepseek2 file of this config holds, by HF name (experts: their stacked shape)."""
    H, h, r, dr = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dn, dv, E, I = c.qk_nope_head_dim, c.v_head_dim, c.n_routed_experts, c.moe_intermediate_size
    want = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        want["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        want.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                     a + "kv_a_proj_with_mqa.weight": (r + dr, H), a + "kv_a_layernorm.weight": (r,),
                     a + "o_proj.weight": (H, h * dv)})
        if c.q_lora_rank is None:
            want[a + "q_proj.weight"] = (h * (dn + dr), H)
        else:
            want.update({a + "q_a_proj.weight": (c.q_lora_rank, H), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                         a + "q_b_proj.weight": (h * (dn + dr), c.q_lora_rank)})
        if kv_b_joined:
            want[a + "kv_b_proj.weight"] = (h * (dn + dv), r)
        else:
            want.update({a + "k_b": (h, r, dn), a + "v_b": (h, dv, r)})
        if not c.is_moe_layer(i):
            want.update({p + "mlp.gate_proj.weight": (c.intermediate_size, H),
                         p + "mlp.up_proj.weight": (c.intermediate_size, H),
                         p + "mlp.down_proj.weight": (H, c.intermediate_size)})
            continue
        S = I * c.n_shared_experts
        want.update({p + "mlp.gate.weight": (E, H), p + "mlp.experts.gate_proj": (E, I, H),
                     p + "mlp.experts.up_proj": (E, I, H), p + "mlp.experts.down_proj": (E, H, I),
                     p + "mlp.shared_experts.gate_proj.weight": (S, H), p + "mlp.shared_experts.up_proj.weight": (S, H),
                     p + "mlp.shared_experts.down_proj.weight": (H, S)})
        if c.scoring_func == "sigmoid":
            want[p + "mlp.gate.e_score_correction_bias"] = (E,)
    return want
