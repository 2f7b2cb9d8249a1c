"""`SampleTextStream` with the real SmolLM2 tokenizer: the streamed pieces always add up to the final
(non-streamed) text that `check_finished` / `to_sample` produce, over many random token sequences
with multi-byte characters split across tokens, special tokens, stop tokens and stop strings that
span tokens."""

import random

import pytest

from forklm.sampling.sample_state import SampleState, check_finished, to_sample
from forklm.sampling.params import SamplingParams
from forklm.server.text_stream import SampleTextStream

TEXTS = ["héllo wörld, ça va?", "日本語のテキスト", "emoji 😀🎉 ok 👍🏽", "def f(x):\n    return x\n",
         "a. b , c ' d\t", "Ελληνικά και русский", "€100 — “quotes”"]


@pytest.fixture(scope="module")
def tok(smollm2_f32):
    return smollm2_f32.tokenizer


@pytest.fixture(scope="module")
def token_pool(tok):
    """Tokens of multilingual text, tokens that are pieces of a UTF-8 character, special tokens."""
    pool = set()
    for t in TEXTS:
        pool.update(tok.encode(t, add_special_tokens=False))
    partial, special = [], []
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial.append(i)
        if tok.decode([i]) == "":
            special.append(i)
    assert partial and special
    return sorted(pool), partial, special


def run_stream(tok, ids, params, stop_ids):
    """Feeds `ids` one token at a time as the engine does; returns (pieces, final text, finish)."""
    st = SampleState(0)
    ts = SampleTextStream(tok.decode, params.stop)
    pieces = []
    for t in ids:
        st.token_ids.append(t)
        st.logprobs.append(0.0)
        if check_finished(st, params, stop_ids, tok.decode):
            final = to_sample(st, tok.decode)
            pieces.append(ts.finish(final.text))
            return pieces, final.text, final.finish_reason
        pieces.append(ts.push(t))
        # what was streamed so far is final: it begins the text decoded so far
        assert tok.decode(st.token_ids).startswith("".join(pieces)) or "\ufffd" in tok.decode(st.token_ids)
    raise AssertionError("max_tokens = len(ids) must finish the sample")


def random_stops(rng: random.Random, full: str, count: int, p_piece: float, span: int, others: list[str]) -> tuple:
    """Up to 4 distinct stop strings: pieces of the text (often spanning tokens), or from `others`."""
    stops = []
    for _ in range(count):
        if full and rng.random() < p_piece:
            a = rng.randrange(len(full))
            stops.append(full[a:rng.randint(a + 1, min(len(full), a + span))])
        else:
            stops.append(rng.choice(others))
    return tuple(dict.fromkeys(s for s in stops if s))[:4]


def test_pieces_add_up_to_the_final_text(tok, token_pool):
    common, partial, special = token_pool
    rng = random.Random(1234)
    stopped_by_string = 0
    for trial in range(2500):
        n = rng.randint(1, 30)
        ids = []
        for _ in range(n):
            r = rng.random()
            ids.append(rng.choice(common) if r < 0.6 else rng.choice(partial) if r < 0.8
                       else rng.choice(special) if r < 0.85 else rng.randrange(tok.vocab_size))
        full = tok.decode(ids)
        stops = random_stops(rng, full, rng.randint(0, 4), 0.75, 6, ["\n", "x", "ö", "😀", "return", "本語"])
        stop_ids = set(rng.sample(special, 2)) if rng.random() < 0.3 else set()
        min_tokens = rng.randint(0, min(3, n)) if rng.random() < 0.3 else 0
        params = SamplingParams(max_tokens=n, min_tokens=min_tokens, stop=stops, stop_token_ids=tuple(stop_ids),
                                ignore_eos=True)
        pieces, final, _ = run_stream(tok, ids, params, stop_ids)
        assert "".join(pieces) == final, (trial, ids, stops, pieces, final)
        stopped_by_string += isinstance(final, str) and final != tok.decode(ids) and bool(stops)
    assert stopped_by_string > 200  # the stop-string path was exercised


def test_text_streams_without_delay_when_nothing_can_change(tok, token_pool):
    """No stop strings: every token whose text is complete is streamed at once."""
    common, _, _ = token_pool
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.choice(common) for _ in range(rng.randint(1, 20))]
        ts = SampleTextStream(tok.decode)
        out = ""
        for k, t in enumerate(ids):
            out += ts.push(t)
            text = tok.decode(ids[: k + 1])
            if not text.endswith("\ufffd"):
                assert out == text


def test_stop_string_held_back_across_a_split_character(tok):
    ids = tok.encode("x 日本語", add_special_tokens=False)
    assert tok.token_bytes(ids[1]) == b" \xe6"  # 日 is split over three tokens
    params = SamplingParams(max_tokens=len(ids), stop=("日本",))
    pieces, final, reason = run_stream(tok, ids, params, set())
    assert reason == "stop" and final == "x "
    assert "".join(pieces) == final
    assert all("日" not in p and "\ufffd" not in p for p in pieces)


def test_stop_string_ending_in_a_split_character_is_found(tok):
    ids = tok.encode("x 日本語", add_special_tokens=False)  # 語 is split over three tokens
    params = SamplingParams(max_tokens=len(ids), stop=("本語",))
    _, final, reason = run_stream(tok, ids, params, set())
    assert reason == "stop" and final == "x 日"


def test_text_offsets_point_at_each_tokens_first_character(tok, token_pool):
    """text_offset[i] = characters of the text before token i; a token that starts inside a
    multi-byte character points at that character. Chunked (streamed) equals all at once."""
    from forklm.server.text_stream import TextOffsets

    pool, partial, _ = token_pool
    rng = random.Random(7)
    for trial in range(200):
        ids = [rng.choice(partial if rng.random() < 0.3 else pool) for _ in range(rng.randint(1, 30))]
        whole = TextOffsets(tok).next(ids)
        chunked, stream = [], TextOffsets(tok)
        i = 0
        while i < len(ids):
            j = i + rng.randint(1, 4)
            chunked += stream.next(ids[i:j])
            i = j
        assert chunked == whole
        raw = b""
        for t, off in zip(ids, whole):
            # the complete characters before the token, as the decoded text counts them
            text = raw.decode("utf-8", errors="replace")
            complete = len(text) - (1 if text.endswith("\ufffd") and _incomplete_tail(raw) else 0)
            assert off == complete, (trial, ids, whole)
            raw += tok.token_bytes(t)
    ascii_ids = tok.encode("def f(x):\n    return x\n", add_special_tokens=False)
    offs = TextOffsets(tok).next(ascii_ids)
    assert offs == [sum(len(tok.token_bytes(t)) for t in ascii_ids[:k]) for k in range(len(ascii_ids))]


def _incomplete_tail(raw: bytes) -> bool:
    """True when raw ends inside a UTF-8 character that more bytes could still complete."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    dec.decode(raw)
    return bool(dec.getstate()[0])


def reference_check_finished(st, params, stop_ids, decode) -> bool:
    """check_finished as it was: the whole sample decoded at every step."""
    tok = st.token_ids[-1]
    can_stop = len(st.token_ids) > params.min_tokens
    if can_stop and tok in stop_ids:
        st.finish_reason, st.stop_reason = "stop", tok
        return True
    if params.stop:
        text = decode(st.token_ids)
        if can_stop:
            hits = [(pos, s) for s in params.stop if (pos := text.find(s, max(0, st.checked - len(s) + 1))) >= 0]
            if hits:
                pos, s = min(hits)
                st.text, st.finish_reason, st.stop_reason = text[:pos], "stop", s
                return True
        st.checked = len(text.rstrip("\ufffd"))
    if len(st.token_ids) >= params.max_tokens:
        st.finish_reason = "length"
        return True
    return False


def test_windowed_stop_check_equals_decoding_everything(tok, token_pool):
    """Long samples (the stop check decodes a window of the latest tokens): the same step, text
    and reason as decoding the whole sample every step, with runs of special tokens (no
    characters) and split characters inside and at the edge of the window."""
    common, partial, special = token_pool
    rng = random.Random(99)
    stopped = 0
    for trial in range(700):
        n = rng.randint(20, 140)
        ids = []
        while len(ids) < n:
            r = rng.random()
            if r < 0.05:
                ids += [rng.choice(special)] * rng.randint(1, 30)  # a run of empty text
            else:
                ids.append(rng.choice(common) if r < 0.7 else rng.choice(partial) if r < 0.9
                           else rng.randrange(tok.vocab_size))
        ids = ids[:n]
        full = tok.decode(ids)
        stops = random_stops(rng, full, rng.randint(1, 4), 0.8, 12, ["\n", "ö", "😀", "return", "本語"])
        min_tokens = rng.randint(0, n // 2) if rng.random() < 0.3 else 0
        params = SamplingParams(max_tokens=n, min_tokens=min_tokens, stop=stops, ignore_eos=True)
        got, ref = SampleState(0), SampleState(0)
        for t in ids:
            for st in (got, ref):
                st.token_ids.append(t)
            a = check_finished(got, params, set(), tok.decode)
            b = reference_check_finished(ref, params, set(), tok.decode)
            assert a == b, (trial, len(got.token_ids), stops)
            if a:
                break
        assert (got.finish_reason, got.stop_reason, got.text) == (ref.finish_reason, ref.stop_reason, ref.text)
        stopped += got.finish_reason == "stop"
    assert stopped > 300


def test_windowed_stop_check_with_a_byte_fallback_tokenizer():
    """SentencePiece-style byte fallback (forklm's GGUF 'llama' tokenizers, Llama-2, Mistral): a
    window that cuts a run of <0xNN> tokens decodes the whole run as U+FFFDs; stop strings (a
    newline is a byte token there) are still found at the same step as decoding everything."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "\u2581a", "b", "\u2581hi", "\u2581ok", "x"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])

    def decode(ids):
        return backend.decode(list(ids), skip_special_tokens=True)

    rng = random.Random(5)
    words = ["鬱", "ฃ", "🙂", "😀", "é", " hi", " ok", " a", "b", "x", "\n", "\t"]
    stopped = 0
    for trial in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        ids = backend.encode(text, add_special_tokens=False).ids
        stops = random_stops(rng, decode(ids), rng.randint(1, 3), 0.6, 5, ["\n", "😀", "鬱鬱", " ok"])
        params = SamplingParams(max_tokens=len(ids), stop=stops, ignore_eos=True)
        got, ref = SampleState(0), SampleState(0)
        for t in ids:
            got.token_ids.append(t)
            ref.token_ids.append(t)
            a = check_finished(got, params, set(), decode)
            assert a == reference_check_finished(ref, params, set(), decode), (trial, text, stops)
            if a:
                break
        assert (got.finish_reason, got.stop_reason, got.text) == (ref.finish_reason, ref.stop_reason, ref.text)
        stopped += got.finish_reason == "stop"
    assert stopped > 150


def test_text_offsets_with_a_sentencepiece_tokenizer():
    """SentencePiece (Llama-2, Mistral, GGUF 'llama' tokenizers) writes a space as U+2581 and decoding
    strips the text's leading one: "\u2581hello\u2581world" is "hello world", so the second token
    starts at 5, not 6. Special tokens that decoding skips take no characters; byte-fallback
    pieces of a character point at it. text_offset[i] = len(decode(ids[:i])) wherever that
    prefix is final text."""
    from test_tokenizer import _spm_meta

    from forklm.server.text_stream import TextOffsets
    from forklm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_fields(_spm_meta())
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581world"]
    assert tok.decode(ids) == "hello world"
    assert TextOffsets(tok).next(ids) == [0, 5]

    rng = random.Random(11)
    words = ["hello", " world", " wor", "ld", "☃", "é", "  ", "\n", "12", " h"]
    checked = 0
    for trial in range(400):
        ids = tok.encode("".join(rng.choice(words) for _ in range(rng.randint(1, 12))), add_special_tokens=False)
        for _ in range(rng.randint(0, 2)):  # special tokens anywhere, the start included
            ids.insert(rng.randint(0, len(ids)), rng.choice([1, 2]))
        offsets, stream = [], TextOffsets(tok)
        i = 0
        while i < len(ids):  # streamed in chunks: equal to all at once
            j = i + rng.randint(1, 3)
            offsets += stream.next(ids[i:j])
            i = j
        assert offsets == TextOffsets(tok).next(ids)
        full = tok.decode(ids)
        for k, off in enumerate(offsets):
            before = tok.decode(ids[:k])
            if full.startswith(before) and not before.endswith("\ufffd"):
                assert off == len(before), (trial, ids, k, offsets)
                checked += 1
    assert checked > 1000
