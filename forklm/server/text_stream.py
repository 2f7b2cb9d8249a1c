"""A sample's text, streamed as its tokens arrive, so that the pieces add up to the final text;
and the character offsets of its tokens (`TextOffsets`).

Two things may still change the end of the text decoded so far: a token that ends inside a
UTF-8 character (its bytes decode to U+FFFD until the rest arrives) and a stop string that has
begun but not yet completed (the final text is cut before it). `SampleTextStream` holds both
back. Decoding uses a window of recent tokens (as vLLM's incremental detokenizer does) so each
token costs O(1) decode work, and the window starts a few tokens back so that decoders which
treat a leading space specially (SentencePiece) see the same context as a full decode.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class SampleTextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1  # characters a stop string may still claim
        self.ids: list[int] = []
        self.text = ""  # decoded text of ids[:read]
        self.prefix = 0  # window start (token index)
        self.read = 0  # tokens whose text is in self.text
        self.sent = 0  # characters handed out

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text that is now certain (possibly empty)."""
        self.ids.append(token_id)
        window = self.decode(self.ids[self.prefix :])
        before = self.decode(self.ids[self.prefix : self.read])
        if window.endswith("\ufffd") or not window.startswith(before):
            return ""  # inside a multi-byte character: wait for the rest
        self.text += window[len(before) :]
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)
        # prefix lags a few tokens behind so the window keeps some left context
        return self._take(len(self.text) - self.hold)

    def finish(self, final_text: str) -> str:
        """The rest of the final text (cut at a stop string, without the stop token)."""
        rest = final_text[self.sent :]
        self.sent = len(final_text)
        return rest

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


class TextOffsets:
    """`text_offset` of the completions API: the character at which each token starts in the text.

    Counted from the tokens' bytes with an incremental UTF-8 decoder, so a token that ends inside
    a multi-byte character adds no character until the character completes, and a token that
    starts inside one points at that character. (Counting the lengths of the tokens' labels, as
    "bytes:\\xe4" for such pieces, overcounts.) Invalid bytes count one U+FFFD each, as in the
    decoded text. Two things the decoder does are followed as well: special tokens that decoding
    skips add nothing, and a leading space that it strips from the text (SentencePiece's
    "\u2581hello" at the start decodes to "hello") is not counted; the first token with text is
    decoded once to see how many characters it keeps.

    `tokenizer`: a `forklm.tokenizer.Tokenizer` (token_bytes, decode, special_token_ids).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters completed so far, by the tokens' bytes
        self._lead: int | None = None  # characters decoding drops at the start (None: no text yet)
        self._head: list[int] = []  # the tokens up to the first character, until _lead is known

    def next(self, token_ids: list[int]) -> list[int]:
        """Offsets of these tokens (which follow the ones already given)."""
        tok = self.tokenizer
        out = []
        for t in token_ids:
            out.append(self.chars - (self._lead or 0))
            skipped = t in tok.special_token_ids and tok.decode([t]) == ""
            if not skipped:
                self.chars += len(self._decoder.decode(tok.token_bytes(t)))
            if self._lead is None:
                self._head.append(t)
                if self.chars:
                    self._lead = max(self.chars - len(tok.decode(self._head)), 0)
                    self._head = []
        return out
