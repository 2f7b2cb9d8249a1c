"""How many tokens to draft this step: BASS Algorithm 1, a fixed length, and the measured cost rule.

`BassDraftLength` is the paper's heuristic (one length for the whole batch): grow by `l_incre`
while some sequence accepted its whole draft, else shrink by ceil(l / l_mod) (plus one more on a
consecutive shrink), never below the batch's largest accepted count nor 1, never above `l_limit`.

`CostRule` turns drafts down where verifying them costs more than they save. Each step's wall
time is modelled as `c0 + c1 * rows` (rows: query rows of the forward), fitted by least squares
on the engine's recent steps (a CPU step costs about in proportion to its rows at large n; at
n = 1 the weights dominate and rows are nearly free). Draft tokens are accepted with probability
`alpha` each (a geometric run, estimated as accepted / (accepted + rejections)), so a draft of k
tokens yields (1 - alpha^(k+1)) / (1 - alpha) tokens per sample. It picks the k <= the length
allowed that maximizes tokens per second; k = 0 turns speculation off for the step. While off,
every `probe_every` steps it drafts anyway (at most 2 tokens) so alpha stays measured.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class BassDraftLength:
    """BASS Algorithm 1 (l0 = 7, l_incre = 2, l_mod = 10, l_limit = 32)."""

    l0: int = 7
    l_incre: int = 2
    l_mod: int = 10
    l_limit: int = 32

    def __post_init__(self) -> None:
        self.length = self.l0
        self._s = 0

    def update(self, accepted: list[int]) -> int:
        """accepted: this step's accepted draft tokens per sequence that drafted; returns the next length."""
        if not accepted:
            return self.length
        best = max(accepted)
        if best >= self.length:
            self.length = min(self.length + self.l_incre, self.l_limit)
            self._s = 0
        else:
            self.length = self.length - math.ceil(self.length / self.l_mod) - self._s
            self.length = max(1, best, self.length)
            self._s = 1
        return self.length


@dataclass
class FixedDraftLength:
    length: int

    def update(self, accepted: list[int]) -> int:
        return self.length


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a sample emits from a draft of k tokens, each accepted with probability alpha (the
    run stops at the first rejection; one more token is always drawn)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostRule:
    """The measured rule: the k that maximizes expected tokens per second of step time."""

    def __init__(self, window: int = 64, probe_every: int = 16) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, seconds) of recent steps
        self.accepted = 1.0  # prior: one acceptance in two tries
        self.rejected = 1.0
        self.probe_every = probe_every
        self._off_steps = 0
        self.last_fit: tuple[float, float] | None = None

    def observe_step(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def observe_drafts(self, accepted: int, rejections: int) -> None:
        """A step's drafts: tokens accepted, drafts cut by a rejection (decayed to follow drift)."""
        self.accepted = 0.98 * self.accepted + accepted
        self.rejected = 0.98 * self.rejected + rejections

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def fit(self) -> tuple[float, float] | None:
        """(c0, c1) of step seconds = c0 + c1 * rows over recent steps; None until two row counts
        have been seen. c0 and c1 are clamped at 0 (noise must not make rows look free or negative)."""
        if len(self.samples) < 4:
            return None
        xs = [r for r, _ in self.samples]
        ys = [t for _, t in self.samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx < 1e-9 * max(1.0, mx * mx):
            return None
        c1 = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 0.0)
        c0 = max(my - c1 * mx, 0.0)
        self.last_fit = (c0, c1)
        return c0, c1

    def choose(self, allowed: int, rows_base: int, drafting: int) -> int:
        """The draft length (0..allowed) for a step with `rows_base` rows before drafts and
        `drafting` sequences that would draft."""
        if allowed <= 0 or drafting <= 0:
            return 0
        fit = self.fit()
        if fit is None:
            return allowed  # nothing measured yet: try (the steps measured decide from then on)
        c0, c1 = fit
        a = self.alpha
        base_tokens = rows_base - drafting  # rows that do not draft emit one token each
        best_k, best = 0, rows_base / max(c0 + c1 * rows_base, 1e-12)
        for k in range(1, allowed + 1):
            rate = (base_tokens + drafting * expected_tokens(a, k)) / max(c0 + c1 * (rows_base + drafting * k), 1e-12)
            if rate > best * 1.02:  # a clear gain only
                best_k, best = k, rate
        if best_k == 0:
            self._off_steps += 1
            if self._off_steps >= self.probe_every:  # keep alpha and the fit measured
                self._off_steps = 0
                return min(2, allowed)
        else:
            self._off_steps = 0
        return best_k
