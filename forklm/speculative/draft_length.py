"""How many tokens to draft this step: BASS Algorithm 1, a fixed length, and the measured cost rule.

`BassDraftLength` is the paper's heuristic (one length for the whole batch): grow by `l_incre`
while some sequence accepted its whole draft, else shrink by ceil(l / l_mod) (plus one more on a
consecutive shrink), never below the batch's largest accepted count nor 1, never above `l_limit`.

`CostRule` turns drafts down where verifying them costs more than they save. It does not model
the step's cost, it measures it: the wall time of recent steps for each number of query rows
seen (steps with prompt chunks left out), since on a CPU the cost of rows is far from linear (a
quantized model runs skinny products on the packed kernel and wider ones on a dense copy, so a
step can double in time when drafts push it over that threshold; at large n the step is
compute-bound and every row costs; at n = 1 the weights dominate and a few rows are nearly
free). Draft tokens are accepted with probability `alpha` each (a geometric run, estimated as
accepted / (accepted + rejections)), so a draft of k tokens yields (1 - alpha^(k+1)) / (1 - alpha)
tokens per sample. It picks the k <= the length allowed that maximizes expected tokens per
second; k = 0 turns speculation off for the step. While off, it drafts 2 tokens for one
sequence in eight every `probe_every` steps (an interval that doubles, up to 256, while probes
confirm "off"), so that alpha and the time of wider steps stay measured at a small cost.
Then the clock has the last word: the tokens per second realized by steps with drafts and by
steps without are kept per number of decode sequences, and where drafting measured slower it is
vetoed whatever the model of the step says (re-tested by an occasional full-width probe).
"""

from __future__ import annotations

import math
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

    # Steps of more decode rows than this never draft. Measured (`python -m bench spec`, README "Speculative
    # sampling"): once drafts are accepted raggedly, a request's samples stand at different
    # lengths and the planner reads their tails row by row instead of as one strided view of the
    # lane group, a lasting cost the per-step clock cannot see (n = 16, T = 0.8: 0.80x after
    # only 3 steps with drafts in 128).
    max_rows_base = 8
    # Only a request's lone running sample drafts: the samples of one request decode as one lane
    # group whose tails are one strided read while they have equal lengths; ragged acceptance
    # breaks that for the rest of the generation (tails read row by row), a cost no per-step
    # clock sees. `python -m bench spec` at n = 4, T = 0.8: 0.90x (m_c 256) and 0.84x (m_c 2048) without it.
    # Since ragged tails are one masked strided read (attention/paged.py), without both rules:
    # n = 4, T = 0.8 1.05x / 0.94x, n = 16 0.93x / 0.88x (spec_cpu_float32_avx2_ragged.json): kept.
    solo_only = True

    def __init__(self, probe_every: int = 16, max_probe_every: int = 256, decay: float = 0.7) -> None:
        self.time_of: dict[int, float] = {}  # query rows of a step -> its wall time (moving average)
        self.decay = decay
        self.accepted = 1.0  # prior: one acceptance in two tries
        self.rejected = 1.0
        self.probe_every = self.min_probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._off_steps = 0
        self._probed = False
        self.probing = False  # the last `choose` was a probe: draft for a few sequences only (`probe_sequences`)
        # the realized guard: tokens per second of steps with and without drafts, per number of
        # decode sequences (moving averages); drafts are vetoed where they measured slower
        self.rate: dict[bool, dict[int, float]] = {True: {}, False: {}}
        self._step_drafts: tuple[int, int, int] | None = None  # this step's (draft tokens, sequences, emitted)
        self._vetoed = False
        self._veto_k = 1  # the draft length the step's model chose when the clock vetoed it
        self.full_probe = False  # the last probe tests the veto: every sequence drafts

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` query rows (no prompt chunks) took `seconds`."""
        old = self.time_of.get(rows)
        self.time_of[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        drafts, self._step_drafts = self._step_drafts, None
        if seconds <= 0:
            return
        if drafts is None:
            base, tokens = rows, rows
        else:
            draft_tokens, seqs, emitted = drafts
            base = rows - draft_tokens
            tokens = base - seqs + emitted
            if seqs * 8 < base:  # a cheap probe says little about the rate of drafting for all
                return
        table = self.rate[drafts is not None]
        old = table.get(base)
        r = tokens / seconds
        table[base] = r if old is None else self.decay * old + (1 - self.decay) * r

    def observe_drafts(self, accepted: int, rejections: int, draft_tokens: int = 0, sequences: int = 0,
                       emitted: int = 0) -> None:
        """A step's drafts: tokens accepted, drafts cut by a rejection (decayed to follow drift),
        and for the realized guard its draft tokens, drafting sequences and tokens they emitted."""
        self.accepted = 0.98 * self.accepted + accepted
        self.rejected = 0.98 * self.rejected + rejections
        if sequences:
            self._step_drafts = (draft_tokens, sequences, emitted)

    def drafts_measured_slower(self, rows_base: int) -> bool:
        """Steps with drafts measured fewer tokens per second than steps without, at the nearest
        number of decode sequences measured both ways (within a quarter)."""
        on, off = self.rate[True], self.rate[False]
        near = [b for b in on if b in off or any(abs(c - b) <= b / 4 for c in off)]
        near = [b for b in near if abs(b - rows_base) <= rows_base / 4]
        if not near:
            return False
        b = min(near, key=lambda x: abs(x - rows_base))
        c = b if b in off else min(off, key=lambda x: abs(x - b))
        return on[b] < off[c]

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def estimate(self, rows: int) -> float | None:
        """Seconds of a step of `rows` rows: measured, else interpolated between the nearest row
        counts measured; above the largest, in proportion to rows (pessimistic: wider steps are
        probed before they are trusted); below the smallest, the smallest's time. None: nothing
        measured."""
        t = self.time_of
        if rows in t:
            return t[rows]
        if not t:
            return None
        below = max((r for r in t if r < rows), default=None)
        above = min((r for r in t if r > rows), default=None)
        if below is None:
            return t[above]
        if above is None:
            return t[below] * rows / below
        w = (rows - below) / (above - below)
        return (1 - w) * t[below] + w * t[above]

    def choose(self, allowed: int, rows_base: int, drafting: int) -> int:
        """The draft length (0..allowed) for a step with `rows_base` rows before drafts and
        `drafting` sequences that would draft."""
        self.probing = False
        if allowed <= 0 or drafting <= 0 or rows_base > self.max_rows_base:
            return 0
        base_t = self.estimate(rows_base)
        if base_t is None:
            return 0  # the step without drafts is measured first
        a = self.alpha
        best_k, best = 0, rows_base / max(base_t, 1e-12)
        for k in range(1, allowed + 1):
            rate = (rows_base - drafting + drafting * expected_tokens(a, k)) / max(
                self.estimate(rows_base + drafting * k), 1e-12)
            if rate > best * 1.02:  # a clear gain only
                best_k, best = k, rate
        self.full_probe = False
        if best_k and self.drafts_measured_slower(rows_base):
            self._veto_k, best_k, self._vetoed = best_k, 0, True  # the model of the step says yes, the clock says no
        elif best_k:
            self._off_steps, self._probed, self._vetoed = 0, False, False
            self.probe_every = self.min_probe_every
            return best_k
        if self._probed:  # the last probe did not turn drafting on: probe less often
            self._probed = False
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        self._off_steps += 1
        if self._off_steps >= self.probe_every:  # keep alpha and the wider steps measured
            self._off_steps, self._probed, self.probing = 0, True, True
            if self._vetoed:  # re-test the veto: all sequences draft, as an "on" step would
                self.full_probe, self.probing = True, False
                return min(self._veto_k, allowed)
            return min(2, allowed)
        return 0

    @staticmethod
    def probe_sequences(rows_base: int) -> int:
        """Sequences a probe drafts for: about one in eight of the step's rows (at least one), so
        a probe adds a quarter of the step's rows at most and costs little where drafts do not pay."""
        return max(1, rows_base // 8)
