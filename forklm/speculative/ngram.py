"""A drafter without weights: continue a sample's last tokens from an earlier occurrence of them.

Where: the request's prompt, the sample's own tokens, and its sibling samples' tokens (the `n`
samples of one request repeat each other: same prompt, often the same opening lines). For the
longest suffix of the sample's context (`ngram_max` tokens down to `ngram_min`) that occurred
before with a token after it, the tokens that followed its latest occurrence are the draft.

One `NGramIndex` per request: a dict from n-gram to (source list, index after it), filled
incrementally (each token of each sample is indexed once, when the token after it exists, so a
sample's current suffix never matches itself). Sources are the live token lists, so a draft read
from a sibling extends as far as the sibling has got. Only sample tokens (verified, drawn) are
indexed: drafts never are.
"""

from __future__ import annotations

from collections.abc import Sequence


class NGramIndex:
    def __init__(self, prompt: Sequence[int], ngram_max: int, ngram_min: int) -> None:
        self.prompt = list(prompt)
        self.nmax, self.nmin = ngram_max, ngram_min
        self.table: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self._done: dict[int, int] = {}  # sample index -> its tokens indexed so far (positions < this)
        p = self.prompt
        for end in range(len(p) - 1):  # an n-gram ending at `end`, continued at end + 1
            for n in range(self.nmin, self.nmax + 1):
                if end + 1 >= n:
                    self.table[tuple(p[end + 1 - n : end + 1])] = (p, end + 1)

    def update(self, sample_index: int, tokens: list[int]) -> None:
        """Indexes the sample's tokens that now have a successor (call before `propose`)."""
        done = self._done.get(sample_index, 0)
        last = len(tokens) - 1  # positions < last have a token after them
        if done >= last:
            return
        head = self.prompt[max(0, len(self.prompt) - self.nmax + 1):]  # n-grams may start in the prompt
        h = len(head)
        ctx = head + tokens[:last]
        table = self.table
        for pos in range(done, last):
            end = h + pos  # in ctx
            for n in range(self.nmin, self.nmax + 1):
                if end + 1 >= n:
                    table[tuple(ctx[end + 1 - n : end + 1])] = (tokens, pos + 1)
        self._done[sample_index] = last

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the longest matched suffix of prompt + `tokens`; [] if none matches."""
        if k <= 0:
            return []
        ctx_tail = (self.prompt[-self.nmax:] + tokens[-self.nmax:])[-self.nmax:]
        table = self.table
        for n in range(min(self.nmax, len(ctx_tail)), self.nmin - 1, -1):
            hit = table.get(tuple(ctx_tail[-n:]))
            if hit is not None:
                src, at = hit
                draft = src[at : at + k]
                if draft:
                    return list(draft)
        return []

