"""Random-weight models (a benchmark tool): the tensors are what a Hugging Face checkpoint of the
same config holds, forklm's logits with them equal transformers', and `LLM("random:...")` runs."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from forklm import LLM
from forklm.reference.forked_attention import PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache
from forklm.errors import InvalidArgumentError
from forklm.models.random_weights import NAMED_SHAPES, random_config, random_model, random_weights

from conftest import rel_err

SHAPES = {
    "llama-gqa-tied": (LlamaForCausalLM, LlamaConfig, dict(
        architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=False)),
    "llama-biases": (LlamaForCausalLM, LlamaConfig, dict(
        architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_random_weights_load_into_transformers_and_match_its_logits(name):
    model_cls, config_cls, cfg = SHAPES[name]
    config = random_config(cfg)
    weights = random_weights(config, torch.float32, "cpu", seed=3)
    hf = model_cls(config_cls(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    hf.load_state_dict({k: v.clone() for k, v in weights.items()}, strict=not config.tie_word_embeddings)
    expected = set(hf.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(weights) == expected  # every tensor, named as HF names it, no extras
    model = random_model(cfg, torch.float32, "cpu", seed=3)  # the same draws, built into forklm's model
    ids = torch.randint(0, 300, (11,))
    cache = ForkedKVCache(config.num_layers, config.num_kv_heads, config.head_dim, len(ids), 1, 1, torch.float32, "cpu")
    ours = model.forward(ids, torch.arange(len(ids)), PrefillAttention(cache))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(ours, ref) < 1e-5


def test_named_shapes_are_valid_configs():
    for name in NAMED_SHAPES:
        c = random_config(name)
        assert c.num_heads % c.num_kv_heads == 0
    c = random_config("random:llama3-8b")
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (32, 8, 128, 32)
    assert c.rope.rope_type == "llama3"
    with pytest.raises(InvalidArgumentError, match="unknown random shape"):
        random_config("llama-9000")


def test_llm_from_random_shape_runs_on_token_ids():
    llm = LLM("random:smollm2-135m", dtype="float32", device="cpu")
    assert llm.tokenizer is None
    out = llm.sample([5, 6, 7, 8], n=3, max_tokens=4, seed=1, ignore_eos=True)
    assert [len(s.token_ids) for s in out.samples] == [4, 4, 4]
    assert out.samples[0].text == "".join(f"<{t}>" for t in out.samples[0].token_ids)
    again = llm.generate([{"prompt": [5, 6, 7, 8], "n": 3, "max_tokens": 4, "seed": 1, "ignore_eos": True}])[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]
    with pytest.raises(InvalidArgumentError, match="token ids"):
        llm.sample("def f():", max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="stop"):
        llm.sample([1, 2], max_tokens=2, stop=["x"])
