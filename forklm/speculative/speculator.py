"""The engine's owner of speculative sampling: drafts for a step's decode rows, stats, draft length.

Each step the scheduler hands it the sequences that decode one token (`propose`); it drafts up to
the current length for each eligible one (unconstrained: a constrained sample has jump-forward)
and returns the drafts; the scheduler gets their KV slots and turns each drafted sequence into a
multi-token extend (its pending token and its draft as query rows of the decode step). The output
processor verifies (`verify.py`) and reports each sequence's accepted count back (`observe`),
which drives the draft length (BASS Algorithm 1, or fixed) and the cost rule's acceptance rate;
the engine reports each step's rows and wall time (`observe_step`), the cost rule's other input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from forklm.engine.request import Sequence
from forklm.speculative.config import SpeculativeConfig
from forklm.speculative.draft_length import BassDraftLength, CostRule, FixedDraftLength
from forklm.speculative.ngram import NGramIndex


@dataclass
class SpeculativeMetrics:
    spec_steps: int = 0  # steps that verified at least one draft
    drafts: int = 0  # sequences that verified a draft
    draft_tokens: int = 0  # tokens proposed (and verified)
    accepted_tokens: int = 0  # of those, accepted
    emitted_tokens: int = 0  # tokens the drafted sequences emitted (accepted + one each, less stops)
    draft_s: float = 0.0  # time spent drafting
    verify_s: float = 0.0  # time spent in verification draws and acceptance (the forward is not counted)
    off_steps: int = 0  # steps where the cost rule (or the budget) turned drafting off
    draft_failures: int = 0  # draft-model forwards that raised (those steps decoded without drafts)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_draft(self) -> float:
        """Tokens a drafted sequence emitted per verify step (1 without speculation)."""
        return self.emitted_tokens / self.drafts if self.drafts else 0.0


class Speculator:
    draft_error: BaseException | None = None  # the last draft-model failure

    def __init__(self, config: SpeculativeConfig, drafter=None) -> None:  # DraftModelDrafter for method "draft"
        self.config = config
        self.drafter = drafter
        k = config.fixed_length
        self.length = FixedDraftLength(k) if k is not None else BassDraftLength()
        # a sampled draft's output depends on which positions were drafted: the timing-based cost
        # rule would make seeded runs irreproducible, so it drafts by BASS's rule alone
        sampled = config.method == "draft" and config.draft_temperature > 0
        self.cost = CostRule() if k is None and config.cost_rule and not sampled else None
        self.metrics = SpeculativeMetrics()

    def propose(self, seqs: list[Sequence], room: int) -> list[tuple[Sequence, list[int]]]:
        """Drafts for the step's decode rows `seqs`, at most `room` draft tokens in all."""
        t0 = time.perf_counter()
        length = min(self.length.length, room // max(len(seqs), 1))
        if self.cost is not None and len(seqs) > self.cost.max_rows_base:
            length = 0  # never drafts this wide: no n-gram lookups either
        out: list[tuple[Sequence, list[int]]] = []
        if length > 0:
            updated: set[int] = set()
            for seq in seqs:
                left = self._room_of(seq)
                if left <= 0:
                    continue
                st, req = seq.sample, seq.request
                index = req.spec_state
                if index is None:
                    index = req.spec_state = NGramIndex(req.prompt_ids, self.config.ngram_max, self.config.ngram_min)
                if id(req) not in updated:  # siblings' new tokens, once per request per step
                    updated.add(id(req))
                    for other in req.samples:
                        index.update(other.index, other.token_ids)
                draft = index.propose(st.token_ids, min(length, left))
                if draft:
                    out.append((seq, draft))
        if out and self.cost is not None:
            k = self.cost.choose(max(len(d) for _, d in out), len(seqs), len(out))
            out = [(seq, d[:k]) for seq, d in out if k > 0]
            if self.cost.probing:  # a probe: a few sequences only
                out = out[: self.cost.probe_sequences(len(seqs))]
        if not out:
            self.metrics.off_steps += 1
        self.metrics.draft_s += time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ the draft model (method "draft")
    def plan(self, seqs: list[Sequence], room: int) -> list[tuple[Sequence, int]]:
        """Which of the step's decode rows `seqs` draft, and how many tokens each (at most `room`
        in all): the scheduler reserves their slots, then `draft` runs the draft model."""
        length = min(self.length.length, room // max(len(seqs), 1))
        if self.cost is not None and len(seqs) > self.cost.max_rows_base:
            length = 0  # never drafts this wide: the draft model does not run
        out: list[tuple[Sequence, int]] = []
        if length > 0:
            for seq in seqs:
                left = self._room_of(seq)
                if left > 0:
                    out.append((seq, min(length, left)))
        if out and self.cost is not None:
            k = self.cost.choose(max(k for _, k in out), len(seqs), len(out))
            out = [(seq, min(n, k)) for seq, n in out if k > 0]
            if self.cost.probing:
                out = out[: self.cost.probe_sequences(len(seqs))]
        if not out:
            self.metrics.off_steps += 1
        return out

    def draft(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int]]]:
        """Runs the draft model for the planned sequences (their slots held); [] if it fails (the
        step decodes without drafts; the error is kept in `draft_error`)."""
        if not plan:
            return []
        t0 = time.perf_counter()
        try:
            drafts = self.drafter.draft(plan)
        except Exception as exc:  # noqa: BLE001 - a failing draft forward costs the drafts, not the requests
            self.draft_error = exc
            self.metrics.draft_failures += 1
            for seq, _ in plan:
                seq.draft_computed = min(seq.draft_computed, seq.num_computed)
                seq.draft_probs = None
            return []
        finally:
            self.metrics.draft_s += time.perf_counter() - t0
        return [(seq, d) for (seq, _), d in zip(plan, drafts)]

    def _room_of(self, seq: Sequence) -> int:
        """Draft tokens `seq` may take this step (0: it decodes one token): not a prompt, a
        constrained sample or a known run; not past max_tokens; and, under the cost rule, only a
        request's lone running sample (`CostRule.solo_only`)."""
        st, req = seq.sample, seq.request
        if st is None or st.matcher is not None or st.ahead or not req.params.speculative:
            return 0
        if self.cost is not None and self.cost.solo_only and len(req.running) > 1:
            return 0
        return req.params.max_tokens - len(st.token_ids) - 1  # emitted tokens never pass max_tokens

    def observe(self, drafted: list[int], accepted: list[int], emitted: list[int], verify_s: float) -> None:
        """One step's verification: per drafted sequence its draft length, accepted count and emitted tokens."""
        m = self.metrics
        m.spec_steps += 1
        m.drafts += len(drafted)
        m.draft_tokens += sum(drafted)
        m.accepted_tokens += sum(accepted)
        m.emitted_tokens += sum(emitted)
        m.verify_s += verify_s
        self.length.update(accepted)
        if self.cost is not None:
            self.cost.observe_drafts(sum(accepted), sum(1 for d, a in zip(drafted, accepted) if a < d),
                                     sum(drafted), len(drafted), sum(emitted))

    def observe_step(self, rows: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe_step(rows, seconds)
