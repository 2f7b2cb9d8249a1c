"""Tokenizer: HF `tokenizers` for text <-> ids, jinja2 for chat templates.

Built either from a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`) or from the
metadata of a GGUF file, which stores vocabulary, merges and special ids under llama.cpp's keys.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from forklm.errors import InvalidArgumentError, ModelFileError, UnsupportedModelError
from forklm.models.gguf_file import split_pairs

# Besides the eos id the files name, these end a turn or a document. Chat models stop on their
# end-of-turn token (<|im_end|>, <|eot_id|>) while the file's eos is often the document end, or the
# other way round, and generation_config.json (absent from a GGUF) is where HF lists both. Like
# llama.cpp's "end of generation" set, we stop on any of them -- but only when the vocabulary marks
# it special, so ordinary text that happens to spell one never ends generation.
_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")

# llama.cpp token types (tokenizer.ggml.token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 2, 3, 4, 5

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> regexes applied in order before byte-level BPE (as in llama.cpp's llama-vocab.cpp)
_PRE_SPLITS = {
    "gpt2": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT],  # also when the file names none
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # HF's tokenizer.json: Digits(individual) then GPT-2 ByteLevel
    "llama3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_IGNORE_MERGES = {"llama3", "llama-bpe", "llama-v3"}  # llama.cpp looks whole words up first for these


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a `gguf.GGUFReader` as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Text <-> token ids and chat templates for one model.

    `eos_token_ids`: the file's eos id first, then the end-of-turn/end-of-text tokens in _END_TOKENS that
    the vocabulary marks special. `special_token_ids`: every added token marked special, plus BOS/EOS.
    """

    def __init__(self, backend: _Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 extra_template_tokens: dict[str, str] | None = None) -> None:
        self._tok = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self._template_tokens = {k: v for k, v in (extra_template_tokens or {}).items() if v is not None}
        self._template_tokens.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token))
                                      if v is not None})
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.special_token_ids: set[int] = specials | {i for i in (self.bos_token_id, eos_id) if i is not None}
        ends = [eos_id] + [backend.token_to_id(t) for t in _END_TOKENS]
        ends = [i for i in ends if i is not None and (i == eos_id or i in specials)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ends))
        self._bytes_of: list[bytes] | None = None  # token id -> bytes, built on first use

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no such file (a Hugging Face tokenizer needs tokenizer.json)")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:
            raise ModelFileError(f"{tok_file}: cannot be read as a tokenizer ({e})") from None
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelFileError(f"{cfg_file}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise ModelFileError(f"{cfg_file}: expected a JSON object")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = path / "chat_template.jinja"  # newer layout; wins over tokenizer_config's copy
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        # tokenizer.json's post-processor says whether BOS/EOS get added; tokenizer_config may override.
        probe = backend.encode("", add_special_tokens=True).ids
        bos_id, eos_id = (backend.token_to_id(t) if t else None for t in (bos, eos))
        add_bos = cfg.get("add_bos_token", bos_id is not None and probe[:1] == [bos_id])
        add_eos = cfg.get("add_eos_token", eos_id is not None and bos_id != eos_id and probe[-1:] == [eos_id])
        extra = {k: _token_text(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(backend, bos_token=bos, eos_token=eos, add_bos=bool(add_bos), add_eos=bool(add_eos),
                   chat_template=template, extra_template_tokens=extra)

    @classmethod
    def from_gguf_fields(cls, fields: Any) -> "Tokenizer":
        """From a `gguf.GGUFReader` or a dict of its metadata (see `gguf_metadata`)."""
        meta = fields if isinstance(fields, dict) else gguf_metadata(fields)
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFileError(f"GGUF metadata has {len(tokens)} tokens but {len(types)} token types")
        n = len(tokens)  # llama.cpp pads a vocabulary to the model's rows with "[PAD<id>]" UNUSED tokens:
        while n > 1 and types[n - 1] == _UNUSED:  # not tokens (vocab_size stops before them, so they are masked)
            n -= 1
        tokens, types = tokens[:n], types[:n]
        merges = split_pairs(meta.get("tokenizer.ggml.merges") or [])

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        if kind == "gpt2":
            backend, vocab = _byte_level_bpe(tokens, types, merges, meta.get("tokenizer.ggml.pre", "default"))
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            backend, vocab = _sentencepiece_bpe(tokens, scores, merges,
                                                meta.get("tokenizer.ggml.add_space_prefix", True),
                                                token("unknown") or ("<unk>" if "<unk>" in tokens else None))
        else:
            raise UnsupportedModelError(
                f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")

        named = {token(k) for k in ("bos", "eos", "unknown", "padding")} - {None}
        marked = _ids_of_types(types, (_UNKNOWN, _CONTROL, _USER_DEFINED))  # a few ids of ~50k, found in numpy
        special = [tokens[i] for i in sorted({*marked[_UNKNOWN], *marked[_CONTROL], *_ids_of_texts(tokens, named)})]
        user = [tokens[i] for i in marked[_USER_DEFINED]]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        tokenizer = cls(backend, bos_token=token("bos"), eos_token=token("eos"), add_bos=bool(add_bos),
                        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                        chat_template=meta.get("tokenizer.chat_template"),
                        extra_template_tokens={"unk_token": token("unknown"), "pad_token": token("padding")})
        if all(t in vocab for t in special) and all(t in vocab for t in user):  # no added token took a new id
            tokenizer.__dict__["vocab_size"] = max(vocab.values(), default=-1) + 1  # (get_vocab copies it all)
        return tokenizer

    # ------------------------------------------------------------------ text <-> ids
    @functools.cached_property
    def vocab_size(self) -> int:
        """One more than the largest token id (the model's embedding may have more rows, as padding).
        Not the number of tokens: ids may have gaps (or repeat a piece, in GGUF vocabularies)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text must be a str, got {type(text).__name__}")
        # Special tokens written in the text ("<|im_start|>") always become their ids, as in HF.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise InvalidArgumentError(f"ids: {bad[0]} is not a token id (vocabulary has {n})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        t = self._tok.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None
        if t is None:
            raise InvalidArgumentError(f"id: {i} is not a token id (vocabulary has {self.vocab_size})")
        return t

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for in decoded text (a piece of a UTF-8 character, possibly)."""
        if self._bytes_of is None:
            self._bytes_of = _token_byte_table(self._tok, self.vocab_size)
        if not 0 <= int(i) < len(self._bytes_of):
            raise InvalidArgumentError(f"id: {i} is not a token id (vocabulary has {self.vocab_size})")
        return self._bytes_of[int(i)]

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidArgumentError("this model has no chat template; pass a plain prompt instead")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidArgumentError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        for k, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InvalidArgumentError(f"messages[{k}] must be a dict with string 'role' and 'content', got {m!r}")
        try:
            template = _compile_template(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFileError(f"the model's chat template does not parse: {e}") from None
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **self._template_tokens)
        except jinja2.TemplateError as e:  # raise_exception(...) inside the template, e.g. roles must alternate
            raise InvalidArgumentError(f"chat template rejected the messages: {e}") from None


def _token_byte_table(backend: _Backend, size: int) -> list[bytes]:
    """Each token's bytes: byte-level vocabularies spell bytes in GPT-2's alphabet; SentencePiece
    ones use \u2581 for spaces and <0xXX> for raw bytes; added tokens stand for their own text."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    byte_level = '"ByteLevel"' in json.dumps(decoder)
    inverse = {c: b for b, c in _byte_alphabet().items()}
    added = {i for i in backend.get_added_tokens_decoder()}
    table = []
    for i in range(size):
        t = backend.id_to_token(i) or ""
        if i in added:
            table.append(t.encode("utf-8"))
        elif byte_level and all(c in inverse for c in t):
            table.append(bytes(inverse[c] for c in t))
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            table.append(bytes([int(t[3:5], 16)]))
        else:
            table.append(t.replace("\u2581", " ").encode("utf-8"))
    return table


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; HF's does not, and templates expect HF's.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """The environment HF renders chat templates in: sandboxed, trim_blocks + lstrip_blocks."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _bpe(vocab: dict[str, int], merges: list[tuple], **kw: Any) -> _Backend:
    try:
        pairs = merges if set(map(len, merges)) <= {2} else [m for m in merges if len(m) == 2]
        return _Backend(models.BPE(vocab=vocab, merges=pairs, **kw))
    except Exception as e:  # a merge naming a token the vocabulary lacks
        raise ModelFileError(f"GGUF tokenizer: vocabulary and merges are inconsistent ({e})") from None


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[tuple],
                    pre: str) -> tuple[_Backend, dict[str, int]]:
    # An unknown pre-tokenizer is refused, not replaced: its words would split differently, so the
    # model would see token sequences it was never trained on (text still round-trips, which hides it).
    if pre not in _PRE_SPLITS:
        known = ", ".join(sorted(_PRE_SPLITS))
        raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: {known})")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Normal tokens must be in the byte alphabet; llama.cpp sometimes stores them as raw text.
    # Control/user-defined tokens keep their raw text: they are matched whole, never merged.
    raw = (_CONTROL, _USER_DEFINED)
    if set("".join(tokens)) <= spelled or set(  # the usual file: one pass in C over every token, else without raw ones
            "".join(t for t, ty in zip(tokens, types) if ty not in raw)) <= spelled:
        vocab = _first_ids(tokens)
    else:
        vocab = {}
        for i, t in enumerate(tokens):
            if types[i] not in raw and not set(t) <= spelled:
                t = "".join(alphabet[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
    backend = _bpe(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
    splits = _PRE_SPLITS[pre]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _ids_of_types(types: list[int], wanted: tuple[int, ...]) -> dict[int, list[int]]:
    """{token type: ids of that type, ascending} for each wanted type (numpy's pass, not Python's)."""
    arr = np.asarray(types)
    return {ty: np.flatnonzero(arr == ty).tolist() for ty in wanted}


def _ids_of_texts(tokens: list[str], texts: set[str]) -> list[int]:
    """Every id whose token is one of a few `texts` (list.index's C loop, not a Python one)."""
    ids = []
    for text in texts:
        i = -1
        while True:
            try:
                i = tokens.index(text, i + 1)
            except ValueError:
                break
            ids.append(i)
    return ids


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """piece -> id, the first id of a piece the vocabulary repeats (dict.setdefault's result, built in C)."""
    n = len(tokens)
    return dict(zip(reversed(tokens), range(n - 1, -1, -1)))


def _sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[tuple],
                       add_space_prefix: bool, unk: str | None) -> tuple[_Backend, dict[str, int]]:
    """llama.cpp's SPM tokenizer: repeatedly merge the adjacent pair whose merged piece scores highest,
    falling back to <0xXX> byte tokens. That is BPE with merges ranked by the merged piece's score."""
    vocab = _first_ids(tokens)
    if not merges:  # same order as transformers' generate_merges: score, then longer left/right piece
        cands = [(-scores[i], -k, k - len(t), i, vocab[t[:k]], vocab[t[k:]], t[:k], t[k:])
                 for t, i in vocab.items() for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        merges = [c[-2:] for c in sorted(cands)]
    backend = _bpe(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    # Like llama.cpp (and the original Llama-2 tokenizer.json): spaces become \u2581 and one more is put
    # before the text and after every special token, even if the text starts with a space. (transformers'
    # GGUF conversion uses Metaspace "first": only at the very start, and not before a leading space.)
    space = [normalizers.Replace(" ", "\u2581")]
    prepend = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(prepend + space)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend, vocab
