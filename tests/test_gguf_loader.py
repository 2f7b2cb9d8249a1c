"""forklm.models.gguf_loader: the SmolLM2 GGUF against transformers, tiny written GGUFs, bad files."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from forklm.backend import Backend  # noqa: E402
from forklm.errors import ModelFileError, UnsupportedModelError  # noqa: E402
from forklm.models.gguf_loader import _unpermute, load_gguf  # noqa: E402
from forklm.tokenizer import _byte_alphabet  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)


# ---------------------------------------------------------------------- SmolLM2 vs transformers
def test_weights_match_transformers(ours, hf_model):
    config, weights, _ = ours
    theirs = hf_model.state_dict()
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert set(theirs) - set(weights) == {"lm_head.weight"}  # HF lists the tied head; we leave it out
    assert set(weights) <= set(theirs)
    for name, w in weights.items():
        assert w.dtype == torch.float32 and w.is_contiguous(), name
        assert w.shape == theirs[name].shape, name
        torch.testing.assert_close(w, theirs[name], rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(weights["model.embed_tokens.weight"], theirs["lm_head.weight"], rtol=0, atol=0)


def test_config_matches_transformers(ours, hf_model):
    config, _, tokenizer = ours
    hf = hf_model.config
    assert config.architecture == hf.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (576, 1536, 30)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (9, 3, 64)
    assert config.vocab_size == hf.vocab_size == tokenizer.vocab_size == 49152
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps) == pytest.approx(1e-5)
    theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert config.rope.theta == theta == 100000.0 and config.rope.rope_type == "default"
    assert config.tie_word_embeddings == hf.tie_word_embeddings is True
    assert not config.attention_bias and not config.mlp_bias
    assert config.bos_token_id == hf.bos_token_id == 1
    assert config.eos_token_ids[0] == hf.eos_token_id == 2 and config.eos_token_ids == tokenizer.eos_token_ids
    assert config.dtype is None  # mostly Q4_1: no single dtype to report


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(_unpermute(permute(w, 3), 3), w)
    b = torch.randn(2 * 4)
    assert torch.equal(_unpermute(permute(b, 2), 2), b)
    assert not torch.equal(permute(w, 3), w)


# ---------------------------------------------------------------------- tiny written GGUFs
def _tokenizer_meta(w, pre: str = "qwen2") -> None:
    tokens = list(_byte_alphabet().values()) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3])
    w.add_token_merges([])
    w.add_eos_token_id(258)
    w.add_bos_token_id(256)
    w.add_add_bos_token(False)


def _put(w, name: str, arr: np.ndarray, qtype) -> np.ndarray:
    """Writes arr as qtype; returns what reading it back must give."""
    if qtype in (Q.F32, Q.F16):
        stored = arr.astype(np.float32 if qtype == Q.F32 else np.float16)
        w.add_tensor(name, stored)
        return stored.astype(np.float32)
    if qtype == Q.I32:
        w.add_tensor(name, arr.astype(np.int32))
        return arr
    packed = gguf.quants.quantize(arr.astype(np.float32), qtype)
    w.add_tensor(name, packed, raw_dtype=qtype)
    return gguf.quants.dequantize(packed, qtype).reshape(arr.shape)


def write_tiny(path: Path, arch: str = "qwen2", *, bias: bool = True, tied: bool = False, layers: int = 2,
               extra_meta=None, extra_tensors=None, weight_type=Q.Q8_0, theta=1e6,
               pre: str = "qwen2") -> dict[str, np.ndarray]:
    """A 2-layer model, hidden 64, 4 heads of 16, 2 KV heads. Returns the expected tensors by GGUF name."""
    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv, vocab = 64, 96, 4, 2, 259
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if arch == "llama":
        w.add_rope_dimension_count(hidden // heads)
    _tokenizer_meta(w, pre)
    if extra_meta:
        extra_meta(w)
    expect = {}
    shapes = {"attn_q.weight": (heads * 16, hidden), "attn_k.weight": (kv * 16, hidden),
              "attn_v.weight": (kv * 16, hidden), "attn_output.weight": (hidden, heads * 16),
              "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn)}
    types = [weight_type, Q.F16, Q.BF16, Q.F32]
    expect["token_embd.weight"] = _put(w, "token_embd.weight", rng.standard_normal((vocab, hidden)), Q.Q8_0)
    for i in range(layers):
        for k, (name, shape) in enumerate(shapes.items()):
            expect[f"blk.{i}.{name}"] = _put(w, f"blk.{i}.{name}", rng.standard_normal(shape), types[k % 4])
        if bias:
            for name, n in (("attn_q.bias", heads * 16), ("attn_k.bias", kv * 16), ("attn_v.bias", kv * 16)):
                expect[f"blk.{i}.{name}"] = _put(w, f"blk.{i}.{name}", rng.standard_normal(n), Q.F32)
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            expect[f"blk.{i}.{name}"] = _put(w, f"blk.{i}.{name}", rng.standard_normal(hidden), Q.F32)
    expect["output_norm.weight"] = _put(w, "output_norm.weight", rng.standard_normal(hidden), Q.F32)
    if not tied:
        expect["output.weight"] = _put(w, "output.weight", rng.standard_normal((vocab, hidden)), Q.Q4_0)
    for name, (arr, qtype) in (extra_tensors or {}).items():
        expect[name] = _put(w, name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


HF_NAMES = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
            "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
            "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
            "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}


def hf_name(name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{HF_NAMES[rest]}"


def test_tiny_qwen2_untied_with_biases(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    expect = write_tiny(path)
    config, weights, tok = load_gguf(path)
    assert config.architecture == "qwen2" and config.attention_bias and not config.tie_word_embeddings
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, 259)
    assert config.rope.theta == 1e6 and config.eos_token_ids == (258, 256)
    assert set(weights) == {hf_name(n) for n in expect}
    for name, arr in expect.items():  # Qwen2: stored as is, no q/k permutation
        assert torch.equal(weights[hf_name(name)], torch.from_numpy(np.asarray(arr, dtype=np.float32))), name
    assert tok.decode(tok.encode("héllo<|im_end|>"), skip_special_tokens=False) == "héllo<|im_end|>"
    from forklm.tokenizer import Tokenizer

    direct = Tokenizer.from_gguf_fields(gguf.GGUFReader(path))  # a reader works as well as a dict
    assert direct.encode("héllo<|im_end|>") == tok.encode("héllo<|im_end|>")

    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    sd = theirs.state_dict()
    assert set(sd) == set(weights)
    for name, w in weights.items():
        torch.testing.assert_close(w, sd[name], rtol=1e-6, atol=0, msg=name)


def _llama3_factors(theta, dim, factor, low, high, orig) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py: the rope_freqs.weight it writes for rope_type llama3."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_tiny_llama_permuted_tied_llama3_rope(tmp_path):
    """Llama files: q/k rows come back in HF order; rope_freqs.weight becomes llama3 rope settings."""
    path = tmp_path / "tiny-llama.gguf"

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    # head_dim 16 gives only 8 frequencies; theta 1e4, orig 64 and high 8 put 2 in the smoothed band.
    factors = _llama3_factors(1e4, 16, 8.0, 1.0, 8.0, 64)
    assert ((factors > 1) & (factors < 8)).sum() == 2

    def meta(w):
        w.add_rope_scaling_orig_ctx_len(64)

    expect = write_tiny(path, "llama", bias=False, tied=True, weight_type=Q.F32, extra_meta=meta, theta=1e4,
                        extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    config, weights, _ = load_gguf(path)
    assert config.tie_word_embeddings and not config.attention_bias and "lm_head.weight" not in weights
    assert config.rope.rope_type == "llama3" and config.rope.original_max_position_embeddings == 64
    assert (config.rope.factor, config.rope.low_freq_factor, config.rope.high_freq_factor) == (8.0, 1.0, 8.0)
    for i in range(2):
        q, k = expect[f"blk.{i}.attn_q.weight"], expect[f"blk.{i}.attn_k.weight"]
        got_q = weights[f"model.layers.{i}.self_attn.q_proj.weight"].numpy()
        got_k = weights[f"model.layers.{i}.self_attn.k_proj.weight"].numpy()
        np.testing.assert_array_equal(permute(got_q, 4), q)  # the file holds permute(hf)
        np.testing.assert_array_equal(permute(got_k, 2), k)


def test_llama3_rope_defaults(tmp_path):
    """With fewer than two smoothed frequencies low/high cannot be solved for: Llama 3.1's 1 and 4 are
    assumed and checked against the tensor; a tensor that is not Llama-3 scaling is refused."""
    path = tmp_path / "l3.gguf"
    factors = _llama3_factors(1e6, 16, 32.0, 1.0, 4.0, 8192)
    write_tiny(path, "llama", bias=False, extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    rope = load_gguf(path)[0].rope
    assert (rope.rope_type, rope.factor, rope.low_freq_factor, rope.high_freq_factor) == ("llama3", 32.0, 1.0, 4.0)
    assert rope.original_max_position_embeddings == 8192

    write_tiny(path, "llama", bias=False, extra_tensors={"rope_freqs.weight": (np.linspace(1, 3, 8), Q.F32)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_gguf(path)


def test_rope_scaling_metadata(tmp_path):
    path = tmp_path / "linear.gguf"

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    write_tiny(path, extra_meta=linear)
    config, _, _ = load_gguf(path)
    assert config.rope.rope_type == "linear" and config.rope.factor == 4.0

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    write_tiny(path, extra_meta=yarn)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_tiny(path, "gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        load_gguf(path)


def test_tiny_llama_with_every_bias_matches_transformers(tmp_path):
    """llama.cpp's optional Llama biases (attn_output, ffn_gate/up/down) are applied, not dropped:
    the loaded tensors are exactly a transformers Llama with attention_bias and mlp_bias, and
    forklm's logits equal its logits."""
    transformers = pytest.importorskip("transformers")
    from forklm.models.llama import LlamaModel

    path = tmp_path / "biases.gguf"
    rng = np.random.default_rng(4)
    extra = {f"blk.{i}.{name}": (rng.standard_normal(n) * 0.5, Q.F32) for i in range(2)
             for name, n in (("attn_output.bias", 64), ("ffn_gate.bias", 96), ("ffn_up.bias", 96),
                             ("ffn_down.bias", 64))}
    write_tiny(path, "llama", bias=True, weight_type=Q.F32, extra_tensors=extra)
    config, weights, _ = load_gguf(path)
    assert config.attention_bias and config.o_proj_bias and config.mlp_bias
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)).eval()
    hf.load_state_dict({k: v * 0.1 for k, v in weights.items()}, strict=True)  # every tensor, no extras
    model = LlamaModel(config, {k: v * 0.1 for k, v in weights.items()}, Backend.exact(torch.float32, torch.device("cpu")))
    ids = torch.from_numpy(rng.integers(0, 259, 12))
    ours = model.forward(ids, torch.arange(len(ids)), CausalPrefill())
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


class CausalPrefill:
    """The attention a prompt's forward needs, as plain SDPA (no KV cache)."""

    def attend(self, layer, q, k, v):  # q [T, h, D], k/v [T, g, D] -> [T, h, D]
        p = q.shape[1] // k.shape[1]
        q, k, v = (x.transpose(0, 1) for x in (q, k.repeat_interleave(p, 1), v.repeat_interleave(p, 1)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def test_llama_bias_without_its_siblings_is_refused(tmp_path):
    path = tmp_path / "o-bias.gguf"  # an o bias without q/k/v biases: no Llama config has that
    write_tiny(path, "llama", bias=False, layers=1, extra_tensors={"blk.0.attn_output.bias": (np.zeros(64), Q.F32)})
    with pytest.raises(UnsupportedModelError, match="attn_output.bias"):
        load_gguf(path)


def test_unknown_pre_tokenizer(tmp_path):
    path = tmp_path / "pre.gguf"
    write_tiny(path, layers=1, pre="brand-new-bpe")
    with pytest.raises(UnsupportedModelError, match=r"pre\.gguf.*tokenizer\.ggml\.pre.*'brand-new-bpe'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "int.gguf"
    write_tiny(path, layers=1, weight_type=Q.I32)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*I32"):
        load_gguf(path)


def test_unexpected_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny(path, layers=1, extra_tensors={"blk.0.attn_output.bias": (np.zeros(64), Q.F32)})
    with pytest.raises(UnsupportedModelError, match="attn_output.bias"):
        load_gguf(path)


# ---------------------------------------------------------------------- bad files
def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("kind", ["random", "empty", "head_of_real", "truncated_data"])
def test_corrupt_file(tmp_path, kind, request):
    path = tmp_path / f"{kind}.gguf"
    if kind == "random":
        path.write_bytes(np.random.default_rng(1).bytes(10_000))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "head_of_real":
        with open(request.getfixturevalue("smollm2_gguf"), "rb") as f:
            path.write_bytes(f.read(8192))
    else:
        whole = tmp_path / "whole.gguf"
        write_tiny(whole)
        data = whole.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFileError) as info:
        load_gguf(path)
    assert str(path) in str(info.value)


def test_own_gguf_reader_matches_gguf_readers_fields_and_tensors(smollm2_gguf, tmp_path):
    """forklm.models.gguf_file reads the header ~40x faster than gguf.GGUFReader: the same metadata
    values and the same tensor views (shape, type, bytes); a truncated copy is a ValueError."""
    import gguf
    import numpy as np

    from forklm.models.gguf_file import read_gguf
    from forklm.tokenizer import gguf_metadata

    meta, tensors = read_gguf(smollm2_gguf)
    reader = gguf.GGUFReader(smollm2_gguf)
    ref = {k: v for k, v in gguf_metadata(reader).items() if not k.startswith("GGUF.")}
    assert set(meta) == set(ref)
    for key, want in ref.items():
        if isinstance(want, float) or (isinstance(want, list) and want and isinstance(want[0], float)):
            assert np.allclose(np.array(meta[key]), np.array(want)), key
        else:
            assert meta[key] == want, key
    by_name = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(by_name)
    for t in tensors:
        u = by_name[t.name]
        assert tuple(u.shape) == t.shape and u.tensor_type == t.tensor_type and u.data.dtype == t.data.dtype
        assert u.data.shape == t.data.shape and np.array_equal(u.data, t.data), t.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(smollm2_gguf).read_bytes()[: 3_000_000])
    with pytest.raises(ValueError, match="past the end"):
        read_gguf(cut)


def test_ggml_type_table_agrees_with_the_gguf_package():
    """forklm's reader keeps ggml's type ids and block sizes itself (importing `gguf` costs a tenth of
    a load): every type the gguf package knows, by the same name, id, block and bytes."""
    import gguf

    from forklm.models.gguf_file import GGML_BLOCK_SIZES, GGMLType

    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        ours = GGMLType[qtype.name]
        assert int(ours) == int(qtype) and ours == qtype
        assert GGML_BLOCK_SIZES[ours] == (block, size), qtype.name
    assert len(GGMLType) == len(gguf.GGML_QUANT_SIZES)


def _string_array(strings: list[bytes]) -> bytes:
    import struct

    return b"".join(struct.pack("<Q", len(s)) + s for s in strings)


def test_native_string_reader_equals_the_python_loop():
    """forklm's C++ string reader (kernels/csrc/gguf_strings.cpp) gives the Python loop's strings:
    random ASCII, multi-byte, invalid UTF-8 (replaced), empty ones, from an offset; a string that runs
    past the end is a ValueError, not a read past the buffer; split_pairs is str.split(" ")."""
    import random

    from forklm.kernels import block_gemm
    from forklm.models import gguf_file

    native = gguf_file.native_strings()
    if native is None:
        if os.environ.get("FORKLM_NATIVE_STRINGS") == "0":
            pytest.skip("the C++ string reader is turned off (FORKLM_NATIVE_STRINGS=0)")
        assert block_gemm.build_error() is not None, "the string reader must build where forklm's kernels build"
        pytest.skip("no C++ toolchain here")
    rng = random.Random(0x5EED)
    alphabet = ["a", "Z", " ", "Ġ", "é", "▁", "中", "🙂", "<", "|"]
    strings = [b"", b"\xff\xfe", b"ok\xc3", "Ġthe".encode()]  # empty, invalid, a cut character, the usual
    strings += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))).encode() for _ in range(3000)]
    strings += [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 9))) for _ in range(500)]  # any bytes
    blob = b"\x07" * 13 + _string_array(strings) + b"tail"
    view = memoryview(np.frombuffer(blob, dtype=np.uint8))
    cur = gguf_file._Cursor(view)
    cur.pos = 13
    want = cur.python_strings(len(strings))
    want_end = cur.pos
    got, end = native.read_strings(view, 13, len(strings))
    assert got == want and end == want_end == len(blob) - 4
    assert got[:3] == [s.decode("utf-8", "replace") for s in strings[:3]]
    for cut in (13 + 3, len(blob) - 10):  # inside a length, inside the last string
        short = memoryview(np.frombuffer(blob[:cut], dtype=np.uint8))
        with pytest.raises(ValueError, match="past the end"):
            native.read_strings(short, 13, len(strings))
    huge = memoryview(np.frombuffer(b"\xff" * 8 + b"abc", dtype=np.uint8))  # a length of 2**64 - 1
    with pytest.raises(ValueError, match="past the end"):
        native.read_strings(huge, 0, 1)
    texts = [s.decode("utf-8", "replace") for s in strings] + ["a b", " a", "a ", "a  b", "a b c", " "]
    assert gguf_file.split_pairs(texts) == [tuple(t.split(" ")) for t in texts]
    assert gguf_file.split_pairs(tuple(texts[:50])) == [tuple(t.split(" ")) for t in texts[:50]]  # any sequence
    with pytest.raises(TypeError):
        native.split_pairs(["a b", 3])
    # a count the buffer cannot hold is refused before anything is allocated (a corrupt header)
    with pytest.raises(ValueError, match="past the end"):
        native.read_strings(view, 13, 10**12)
    with pytest.raises(ValueError, match="past the end"):
        native.read_strings(view, 13, 2**64 - 1)
    cur = gguf_file._Cursor(memoryview(np.frombuffer(blob[:17], dtype=np.uint8)))
    cur.pos = 13
    with pytest.raises(ValueError, match="past the end"):  # the Python loop too: a cut length
        cur.python_strings(1)


def test_tokenizer_from_the_native_strings_is_the_python_loops(smollm2_gguf):
    """The vocabulary read by the C++ reader builds the tokenizer the Python loop's strings build:
    the same metadata, special and user tokens, and encodings of text with special tokens in it."""
    from forklm.models import gguf_file
    from forklm.tokenizer import Tokenizer

    if gguf_file.native_strings() is None:
        pytest.skip("no C++ string reader here")
    native_meta, _ = gguf_file.read_gguf(smollm2_gguf)
    original = gguf_file.native_strings
    try:
        gguf_file.native_strings = lambda: None  # the Python loop (and str.split for the merges)
        python_meta, _ = gguf_file.read_gguf(smollm2_gguf)
        slow = Tokenizer.from_gguf_fields(python_meta)
    finally:
        gguf_file.native_strings = original
    assert native_meta == python_meta
    fast = Tokenizer.from_gguf_fields(native_meta)
    assert fast._tok.get_added_tokens_decoder().keys() == slow._tok.get_added_tokens_decoder().keys()
    assert [str(t) for t in fast._tok.get_added_tokens_decoder().values()] == \
        [str(t) for t in slow._tok.get_added_tokens_decoder().values()]
    assert fast.vocab_size == slow.vocab_size and fast.eos_token_ids == slow.eos_token_ids
    text = "<|im_start|>user\nHello, wörld! 1234 ünïcode 🙂<|im_end|>\n  def f(x):\n\treturn x"
    assert fast.encode(text) == slow.encode(text) and fast.decode(fast.encode(text)) == slow.decode(slow.encode(text))
