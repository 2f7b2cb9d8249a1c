"""forklm.tokenizer against transformers' tokenizer for the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forklm.errors import InvalidArgumentError
from forklm.tokenizer import Tokenizer, _byte_alphabet, gguf_metadata

TEXTS = [
    "Hello, world!",
    "12345 and 3.14159, 1,000,000 or 2024-01-31",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "  leading   spaces\t\ttabs and trailing   ",
    "line\r\nbreaks\n\n\n\nmany",
    "héllo wörld ñ café naïve ﬁ ∑ Ω ≈",
    "日本語のテキスト 中文 한국어 العربية עברית",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "it's they're I'll we've she'd IT'S",
    "",
    " ",
    "\n",
    "a" * 100,
    "x=1;y=22;z=333;w=4444",
    "https://example.com/path?q=1&r=two#frag",
    "non\u00a0breaking and zero\u200bwidth",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3? 🙂"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def meta(gguf_path):
    import gguf

    return gguf_metadata(gguf.GGUFReader(gguf_path))


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf_fields(meta)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# ---------------------------------------------------------------------- SmolLM2 GGUF vs transformers
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_special_tokens(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id == 1  # SmolLM2 names <|im_start|> as BOS ...
    assert not tok.add_bos  # ... but never adds it
    assert tok.encode("hi")[0] != 1
    assert tok.eos_token_ids[0] == hf_tok.eos_token_id == 2
    assert tok.id_to_token(2) == "<|im_end|>"
    assert 0 in tok.eos_token_ids  # <|endoftext|>
    hf_special = {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert tok.special_token_ids == hf_special == set(range(17))  # all 17 control tokens of the file
    assert tok.decode([3, 28120, 16]) == hf_tok.decode([3, 28120, 16], skip_special_tokens=True) == "hello"
    assert tok.encode("<|im_start|>") == [1]


def test_bad_arguments(tok):
    with pytest.raises(InvalidArgumentError, match="not a token id"):
        tok.decode([tok.vocab_size])
    with pytest.raises(InvalidArgumentError):
        tok.id_to_token(-1)
    with pytest.raises(InvalidArgumentError, match="text"):
        tok.encode(None)  # type: ignore[arg-type]
    for bad in ([], "hello", [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"],
                [{"role": 1, "content": "x"}]):
        with pytest.raises(InvalidArgumentError, match="messages"):
            tok.apply_chat_template(bad)  # type: ignore[arg-type]


def test_template_errors(tok):
    strict = Tokenizer(tok._tok, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidArgumentError, match="roles must alternate"):
        strict.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        Tokenizer(tok._tok).apply_chat_template(CONVERSATIONS[0])


def test_template_environment(tok):
    t = Tokenizer(tok._tok, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=(
        "{% for m in messages %}\n  {{ bos_token }}{{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}GO{% endif %}"))
    out = t.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    # trim_blocks + lstrip_blocks; tojson without HTML escaping or ASCII escaping, like HF
    assert out == '  <|im_start|>"<b>é</b>"<|im_end|>\nGO'


# ---------------------------------------------------------------------- HF folder layout
def test_from_hf_folder(tmp_path, tok, meta):
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    template = meta["tokenizer.chat_template"]
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True,
           "chat_template": [{"name": "default", "template": template}, {"name": "tool_use", "template": "x"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = Tokenizer.from_hf_folder(tmp_path)
    assert hf.add_bos and hf.bos_token_id == 1 and hf.eos_token_ids == tok.eos_token_ids
    assert hf.encode("Hello 123") == [1] + tok.encode("Hello 123")
    assert hf.encode("Hello 123", add_special_tokens=False) == tok.encode("Hello 123")
    assert hf.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(CONVERSATIONS[0]) == "Hi there"

    transformers = pytest.importorskip("transformers")
    cfg["eos_token"] = "<|im_end|>"  # transformers 5 rejects the {"content": ...} spelling
    del cfg["add_bos_token"]  # (and transformers 5's generic backend ignores it)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert not ours.add_bos
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)


def test_from_hf_folder_bos_from_post_processor(tmp_path, tok):
    """Without add_bos_token in tokenizer_config.json, tokenizer.json's post-processor decides."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    backend = Backend.from_str(tok._tok.to_str())
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    t = Tokenizer.from_hf_folder(tmp_path)
    assert t.add_bos and t.encode("hi") == [1] + tok.encode("hi") and t.chat_template is None
    assert t.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_vocab_size_covers_ids_past_a_gap():
    """vocab_size bounds the ids (the model masks logits at and above it), so it is the largest id + 1,
    not the count of tokens: a vocabulary with a gap used to hide its highest ids."""
    from tokenizers import models
    from tokenizers import Tokenizer as Backend

    t = Tokenizer(Backend(models.WordLevel(vocab={"a": 0, "b": 1, "c": 5, "<unk>": 2}, unk_token="<unk>")))
    assert t.vocab_size == 6
    assert t.decode([5, 0]) == "c a" and t.id_to_token(5) == "c"


def test_from_hf_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    from forklm.errors import ModelFileError

    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# ---------------------------------------------------------------------- other GGUF tokenizer kinds
def _byte_vocab_meta(pre: str) -> dict:
    """A byte-level vocabulary whose merges build digit runs and ' 1', so pre-tokenizers show in ids."""
    alphabet = list(_byte_alphabet().values())
    merges = ["Ġ 1", "1 2", "12 3", "123 4", "h e", "he l", "hel l", "hell o", "Ġ hello"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": len(tokens) - 1}


@pytest.mark.parametrize("pre, expected", [
    ("qwen2", ["hello", "Ġ", "1", "2", "3", "4", "5"]),
    ("llama3", ["hello", "Ġ", "123", "4", "5"]),
    ("llama-bpe", ["hello", "Ġ", "123", "4", "5"]),
    ("smollm", ["hello", "Ġ", "1", "2", "3", "4", "5"]),
    ("gpt2", ["hello", "Ġ1", "2", "3", "4", "5"]),  # " 12345" is one piece: merges apply left to right
    ("gpt-2", ["hello", "Ġ1", "2", "3", "4", "5"]),  # llama.cpp's spelling
    (None, ["hello", "Ġ1", "2", "3", "4", "5"]),  # no tokenizer.ggml.pre: llama.cpp's "default"
])
def test_byte_level_pre_tokenizers(pre, expected):
    meta = _byte_vocab_meta(pre)
    if pre is None:
        del meta["tokenizer.ggml.pre"]
    t = Tokenizer.from_gguf_fields(meta)
    assert [t.id_to_token(i) for i in t.encode("hello 12345")] == expected
    assert t.decode(t.encode("hello 12345 ✓<|im_end|>"), skip_special_tokens=False) == "hello 12345 ✓<|im_end|>"
    assert t.eos_token_ids == (t.vocab_size - 1, t.vocab_size - 2)


def test_gguf_padding_tokens_are_not_tokens():
    """llama.cpp writes a vocabulary padded to the model's rows (Qwen2: 151936 for 151665 tokens) with
    "[PAD<id>]" tokens of type UNUSED; vocab_size stops before them, so the model masks their ids."""
    meta = _byte_vocab_meta("qwen2")
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] += [f"[PAD{i}]" for i in range(n, n + 5)]
    meta["tokenizer.ggml.token_type"] += [5] * 5
    t = Tokenizer.from_gguf_fields(meta)
    assert t.vocab_size == n and t.decode(t.encode("[PAD300] hello")) == "[PAD300] hello"


def _vocab_size_the_slow_way(t: Tokenizer) -> int:
    return max(t._tok.get_vocab(with_added_tokens=True).values()) + 1


def test_gguf_vocab_size_is_the_largest_id_plus_one(tok):
    """A GGUF tokenizer knows its vocab_size at build time (the largest id its pieces keep) instead of
    asking the backend for its whole vocabulary; the two agree, a repeated piece (the first id keeps
    it) and a special token stored as raw text included."""
    assert tok.vocab_size == _vocab_size_the_slow_way(tok) == 49152
    meta = _byte_vocab_meta("qwen2")
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["hello"]  # the last id repeats a piece
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1]
    t = Tokenizer.from_gguf_fields(meta)
    assert "vocab_size" in t.__dict__ and t.vocab_size == _vocab_size_the_slow_way(t)
    meta = _byte_vocab_meta("qwen2")
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<raw unknown>"]  # type UNKNOWN, raw text
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [2]
    t = Tokenizer.from_gguf_fields(meta)
    assert t.vocab_size == _vocab_size_the_slow_way(t)


def test_unknown_pre_tokenizer_is_refused_by_name():
    """It used to fall back to GPT-2's regex silently: text round-trips, but words split unlike in training."""
    from forklm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'some-future-type'"):
        Tokenizer.from_gguf_fields(_byte_vocab_meta("some-future-type"))


@pytest.mark.parametrize("pre", ["qwen2", "llama3", "gpt2"])
def test_byte_level_matches_transformers_conversion(pre):
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = _byte_vocab_meta(pre)
    ours = Tokenizer.from_gguf_fields(meta)
    theirs, _ = conv.convert_gguf_tokenizer("qwen2", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": meta["tokenizer.ggml.token_type"], "merges": meta["tokenizer.ggml.merges"]})
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text


def _spm_meta() -> dict:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "▁wor",
              "▁world", "ld", "▁", "1", "2"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(dict.fromkeys(pieces))
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(len(t)) * 0.5 - 0.01 * k for k, t in enumerate(tokens[259:])]
    scores[tokens.index("▁hello")] = 5.0
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_gguf():
    t = Tokenizer.from_gguf_fields(_spm_meta())
    assert t.add_bos and t.bos_token_id == 1 and t.eos_token_ids == (2,)
    ids = t.encode("hello world")
    assert ids[0] == 1 and [t.id_to_token(i) for i in ids[1:]] == ["▁hello", "▁world"]
    # characters outside the vocabulary fall back to UTF-8 byte tokens and decode back
    for text in ["hello world", "héllo 12 ☃", "  two spaces", "hello\nworld"]:
        assert t.decode(t.encode(text)) == text
    assert [t.id_to_token(i) for i in t.encode("☃", add_special_tokens=False)] == [
        "▁", "<0xE2>", "<0x98>", "<0x83>"]


def test_sentencepiece_matches_transformers_conversion():
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    meta = _spm_meta()
    ours = Tokenizer.from_gguf_fields(meta)
    theirs, _ = conv.convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": meta["tokenizer.ggml.tokens"],
        "scores": meta["tokenizer.ggml.scores"], "token_type": meta["tokenizer.ggml.token_type"]})
    for text in ["hello world", "hello  world", "helloworld", "héllo 12 ☃ wor", "a\nb", ""]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False).ids, text
    # Where they differ, we do what llama.cpp does: a space is prepended even before a leading space,
    # and again after a special token written in the text.
    assert [ours.id_to_token(i) for i in ours.encode(" hello</s>hello", add_special_tokens=False)] == [
        "▁", "▁hello", "</s>", "▁hello"]
    assert [theirs.id_to_token(i) for i in theirs.encode(" hello</s>hello", add_special_tokens=False).ids] == [
        "▁hello", "</s>", "hello"]


def test_unsupported_tokenizer_model():
    from forklm.errors import UnsupportedModelError

    meta = dict(_spm_meta(), **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Tokenizer.from_gguf_fields(meta)
