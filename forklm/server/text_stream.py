"""A sample's text, streamed as its tokens arrive, so that the pieces add up to the final text.

Two things may still change the end of the text decoded so far: a token that ends inside a
UTF-8 character (its bytes decode to U+FFFD until the rest arrives) and a stop string that has
begun but not yet completed (the final text is cut before it). `SampleTextStream` holds both
back. Decoding uses a window of recent tokens (as vLLM's incremental detokenizer does) so each
token costs O(1) decode work, and the window starts a few tokens back so that decoders which
treat a leading space specially (SentencePiece) see the same context as a full decode.
"""

from __future__ import annotations

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
