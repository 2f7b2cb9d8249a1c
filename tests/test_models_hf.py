"""Random-weight checkpoints written by transformers' save_pretrained: forklm's logits == transformers'."""

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from forklm.backend import Backend
from forklm.reference.forked_attention import DecodeAttention, PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache
from forklm.config import ModelConfig
from forklm.errors import ModelFileError, UnsupportedModelError
from forklm.models.hf_loader import load_hf_weights
from forklm.models.llama import LlamaModel

from conftest import rel_err

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)

VARIANTS = {
    "llama-mha": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mqa": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama3-rope": (LlamaForCausalLM, LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    # q/k/v/o and gate/up/down biases (the o and MLP ones used to be dropped silently)
    "llama-biases": (LlamaForCausalLM, LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                                         attention_bias=True, mlp_bias=True)),
}


def save_random(tmp_path: Path, variant: str, seed: int = 0, **save_kwargs):
    model_cls, config_cls, kw = VARIANTS[variant]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**SMALL, **kw)).eval()
    with torch.no_grad():  # random weights with some scale, so logits are not near-uniform
        for p in hf.parameters():
            p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path, **save_kwargs)
    return hf


def forklm_logits(folder: Path, ids: torch.Tensor, decode_ids: torch.Tensor, path: str, dtype=torch.float32):
    """Logits at every prompt position, then after each decode token (one sample)."""
    cfg = ModelConfig.from_json_file(folder / "config.json")
    model = LlamaModel(cfg, load_hf_weights(folder), Backend.exact(dtype, torch.device("cpu")))
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), len(decode_ids), 1, dtype, "cpu")
    prefill = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
    cache.fork()
    steps = []
    for t, tok in enumerate(decode_ids):
        steps.append(model.forward(tok[None], torch.tensor([len(ids) + t]), DecodeAttention(cache, path)))
        cache.own_len += 1
    return prefill, torch.cat(steps)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["standard", "bifurcated"])
def test_logits_match_transformers(tmp_path, variant, path):
    hf = save_random(tmp_path, variant)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (40,), generator=gen)
    more = torch.randint(0, SMALL["vocab_size"], (6,), generator=gen)
    prefill, steps = forklm_logits(tmp_path, ids, more, path)
    with torch.no_grad():
        ref = hf(torch.cat([ids, more])[None]).logits[0]
    assert rel_err(prefill, ref[:40]) < 1e-5
    assert rel_err(steps, ref[40:]) < 1e-5
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_bfloat16_logits_close_to_float32(tmp_path):
    save_random(tmp_path, "llama-gqa")
    ids = torch.randint(0, SMALL["vocab_size"], (30,), generator=torch.Generator().manual_seed(2))
    p32, s32 = forklm_logits(tmp_path, ids, ids[:4], "bifurcated", torch.float32)
    p16, s16 = forklm_logits(tmp_path, ids, ids[:4], "bifurcated", torch.bfloat16)
    assert rel_err(p16, p32) < 3e-2 and rel_err(s16, s32) < 3e-2


def test_sharded_checkpoint_loads_the_same(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    save_random(one, "llama-mqa", seed=5)
    save_random(sharded, "llama-mqa", seed=5, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_hf_weights(one), load_hf_weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_in_the_wild_old_and_new_keys():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100}
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf_dict({**base, "dtype": "bfloat16",
                                    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert old == new
    assert old.rope.theta == 5e5 and old.rope.rope_type == "linear" and old.dtype == "bfloat16"
    minimal = ModelConfig.from_hf_dict(base)  # optional keys missing: their defaults
    assert minimal.num_kv_heads == 4 and minimal.head_dim == 16 and minimal.rope.theta == 10000.0
    assert minimal.rms_norm_eps == 1e-6 and not minimal.tie_word_embeddings


def test_bad_configs_are_named(tmp_path):
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelFileError, match="hidden_size"):
        ModelConfig.from_hf_dict({"model_type": "llama"})
    with pytest.raises(UnsupportedModelError, match="gelu"):  # the MLP is SiLU-gated; another activation is refused
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10,
                                  "hidden_act": "gelu"})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelFileError, match="config.json"):
        ModelConfig.from_json_file(bad)


def test_corrupt_safetensors_is_named(tmp_path):
    save_random(tmp_path, "llama-mha")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelFileError, match="model.safetensors"):
        load_hf_weights(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    save_random(tmp_path, "llama-mha")
    w = load_hf_weights(tmp_path)
    del w["model.layers.1.mlp.down_proj.weight"]
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ModelFileError, match="model.layers.1.mlp.down_proj.weight"):
        LlamaModel(cfg, w, Backend.exact(torch.float32, torch.device("cpu")))


@pytest.mark.parametrize("variant, extra", [
    ("llama-mha", "model.layers.1.self_attn.o_proj.bias"),  # attention_bias is False
    ("llama-mha", "model.layers.0.mlp.up_proj.bias"),  # mlp_bias is False
    ("qwen2", "model.layers.0.self_attn.o_proj.bias"),  # Qwen2 has no o bias (transformers builds none)
    ("qwen2", "model.layers.1.mlp.down_proj.bias"),
    ("llama-mha", "model.layers.0.self_attn.q_norm.weight"),  # another architecture's tensor
])
def test_tensors_the_model_does_not_use_are_refused_by_name(tmp_path, variant, extra):
    """In the file itself (written next to the checkpoint's tensors), not only in the dict."""
    from safetensors.torch import save_file

    save_random(tmp_path, variant)
    w = load_hf_weights(tmp_path)
    w[extra] = torch.ones(SMALL["hidden_size"])
    save_file(w, tmp_path / "model.safetensors")
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(UnsupportedModelError, match=re.escape(extra)):
        LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.float32, torch.device("cpu")))


def test_biases_the_config_asks_for_must_be_there(tmp_path):
    save_random(tmp_path, "llama-biases")
    w = load_hf_weights(tmp_path)
    del w["model.layers.1.mlp.gate_proj.bias"]
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias
    with pytest.raises(ModelFileError, match="model.layers.1.mlp.gate_proj.bias"):
        LlamaModel(cfg, w, Backend.exact(torch.float32, torch.device("cpu")))


def test_padded_vocabulary_ids_are_masked(tmp_path):
    """A config vocabulary padded beyond the tokenizer's (Qwen2: 151936 rows for ~151665 tokens):
    logits of the padding ids are -inf; the others are unchanged."""
    save_random(tmp_path, "qwen2")
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    model = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.float32, torch.device("cpu")))
    assert model.num_valid_tokens == SMALL["vocab_size"]  # nothing masked by default
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4))
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), 1, 1, torch.float32, "cpu")
    full = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
    model.num_valid_tokens = 300
    cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), 1, 1, torch.float32, "cpu")
    masked = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
    assert torch.equal(masked[:, :300], full[:, :300]) and torch.isfinite(full).all()
    assert (masked[:, 300:] == float("-inf")).all()


def test_padded_vocabulary_ids_are_never_sampled(tmp_path):
    """Through `LLM`: a tokenizer of 300 tokens with a 320-row model. At temperature 50 the draw is
    near uniform, so without the mask ~6% of the draws would be ids the tokenizer cannot decode."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from forklm import LLM

    save_random(tmp_path, "qwen2")
    backend = Backend(models.WordLevel(vocab={f"w{i}": i for i in range(300)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert llm.tokenizer.vocab_size == 300 and llm.config.vocab_size == 320
    out = llm.sample("w1 w2 w3", n=16, max_tokens=24, temperature=50.0, seed=0, ignore_eos=True)
    drawn = [t for s in out.samples for t in s.token_ids]
    assert len(drawn) == 16 * 24 and max(drawn) < 300
    assert len(set(drawn)) > 150  # the draws did spread over the vocabulary


def test_weight_layouts_agree_and_the_choice_is_fixed(tmp_path):
    """Both layouts give the same logits; the default is a rule of (device, dtype), not a timing,
    so every process multiplies the same way and seeded samples repeat across runs."""
    save_random(tmp_path, "llama-gqa")
    cfg = ModelConfig.from_json_file(tmp_path / "config.json")
    ids = torch.randint(0, SMALL["vocab_size"], (24,), generator=torch.Generator().manual_seed(3))
    logits = {}
    for layout in ("in_out", "out_in", None):
        model = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.float32, torch.device("cpu"), weight_layout=layout))
        cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(ids), 1, 1, torch.float32, "cpu")
        logits[layout] = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
        if layout is None:
            assert model.weight_layout == "in_out"  # float32 on CPU
    assert rel_err(logits["in_out"], logits["out_in"]) < 1e-5
    assert torch.equal(logits[None], logits["in_out"])
    bf16 = LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.bfloat16, torch.device("cpu")))
    assert bf16.weight_layout == "out_in"
    with pytest.raises(ValueError, match="weight_layout"):
        LlamaModel(cfg, load_hf_weights(tmp_path), Backend.exact(torch.float32, torch.device("cpu"), weight_layout="rows"))
