"""The scheduler: policy only. Which requests run this step, in what order, with how many tokens.

Each step (`schedule`), oldest request first:
  (a) every running sample with one pending token decodes; it gets a slot for its token from
      the KV manager, preempting the youngest work if blocks run out; a sample whose pending
      tokens are its last drawn one and a run of known ones after it (`SampleState.ahead`: a run
      its grammar forces, jump-forward) *extends* by all of them in one step, as several query
      rows of the decode step (`ScheduledBatch.extend`), with slots for all of them; with
      speculative sampling on, decode rows the speculator drafts for extend by their pending
      token and the draft (`Sequence.draft`, verified by the output processor);
  (b) prompts being prefilled and samples being recomputed take prompt chunks from the token
      budget (`max_batch_tokens`, chunked prefill), each at most an eighth of it while requests
      wait (the budget shared with newcomers: a short request beside a long prompt starts at once,
      in a short step);
  (c) samples waiting for blocks or a decode row (waves of a large n, preempted samples) start,
      at most `max_num_seqs` running sequences in all; fresh samples of a request start
      together as one lane group;
  (d) waiting requests are admitted in cache-aware order (longest cached prefix first; a
      request that waited `max_wait_steps` steps goes first; FCFS when more than
      `cache_aware_max_waiting` wait, so ordering stays cheap) or FCFS.

Preemption victims: the youngest work the needy sequence outranks: a sample first, then a whole
request (which returns to the queue and finds its prompt in the prefix cache). The scheduler
never touches a block count: it asks the KV manager.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from forklm.engine.kv_manager import KVManager
from forklm.engine.request import RequestState, Sequence, Status

# While requests wait to be admitted, a running prompt's chunk takes at most 1/WAITING_CHUNK_SHARE of
# the step's budget: the step that admits a newcomer costs little more than the newcomer's own
# prefill (with half the budget, a short request's first token waited for the running chunk and
# then for half a chunk more beside its own; measured through `forklm serve`: docs/serving.md).
WAITING_CHUNK_SHARE = 8


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # one new token each
    # Multi-token extends: every pending token of each (its last drawn token and the known tokens
    # after it) in this step, as decode rows (causal among themselves, shared prompt blocks read
    # once with the other rows), with logits at every one of them.
    extend: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)  # tokens [s0, s1) of a sequence
    extend_logits_last_only: bool = False  # logits at an extend's last row only (a draft model catching up)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks and not self.extend

    def requests(self) -> list[RequestState]:
        seen: dict[int, RequestState] = {}
        for seq in self.decode + self.extend + [c[0] for c in self.chunks]:
            seen.setdefault(id(seq.request), seq.request)
        return list(seen.values())


class Scheduler:
    def __init__(self, config, kv: KVManager, metrics, speculator=None) -> None:  # EngineConfig, EngineMetrics, Speculator
        self.config = config
        self.kv = kv
        self.metrics = metrics
        self.speculator = speculator
        self.waiting: list[RequestState] = []
        self.active: list[RequestState] = []  # PREFILLING / RUNNING, in arrival order
        self.num_running = 0  # sequences in `running` lists (decode rows and their recomputes)

    def add(self, req: RequestState) -> None:
        self.waiting.append(req)

    def remove(self, req: RequestState) -> None:
        """Forgets a request that ended (its blocks are already released)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.active:
            self.active.remove(req)

    def margin(self) -> int:
        """Blocks kept free beside a reservation ahead: one per running sequence and request."""
        return self.num_running + len(self.active)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        scheduled: set[int] = set()  # id() of sequences already in this step
        more: list[Sequence] = []  # prompts and recomputes (more than one token pending), for (b)
        budget = self.config.max_batch_tokens - self._schedule_decodes(batch, scheduled, more)  # (a)
        if self.speculator is not None and batch.decode:
            budget -= self._speculate(batch, budget)
        budget = self._schedule_chunks(batch, scheduled, more, budget)  # (b)
        budget = self._start_pending_samples(batch, scheduled, budget)  # (c)
        self._admit_waiting(batch, scheduled, budget)  # (d)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch, scheduled: set[int], more: list[Sequence]) -> int:
        """(a) Decode rows (one pending token) and extends (a drawn token and its known run), with
        slots for them, preempting younger work if blocks run out; prompts and recomputes (more
        than one token pending) are appended to `more` for (b). Returns the tokens scheduled."""
        metrics, bs = self.metrics, self.kv.block_size
        preemptions = metrics.preempted_samples
        used = 0
        for req in list(self.active):
            if req.status is Status.PREFILLING:
                more.append(req.prompt_seq)
            for seq in list(req.running):
                pending = len(seq.tokens) - seq.num_computed
                ahead = seq.sample.ahead
                if ahead and pending == len(ahead) + 1:  # a known run after the drawn token: one extend
                    if metrics.preempted_samples != preemptions and seq not in req.running:
                        continue
                    if self._ensure_slot(seq, scheduled, pending):
                        batch.extend.append(seq)
                        scheduled.add(id(seq))
                        used += pending
                    continue
                if pending > 1:
                    more.append(seq)
                if pending != 1:
                    continue
                if metrics.preempted_samples != preemptions and seq not in req.running:
                    continue  # preempted for an older sequence in this loop
                # a slot already held (the common case) needs no question to the KV manager
                if seq.num_computed < len(seq.block_table) * bs or self._ensure_slot(seq, scheduled):
                    batch.decode.append(seq)
                    scheduled.add(id(seq))
        return used + len(batch.decode)

    def _add_chunk(self, batch: ScheduledBatch, scheduled: set[int], seq: Sequence, budget: int,
                   cap: int | None = None) -> int:
        """Schedules the next tokens of a sequence with more than its decode token pending (a
        prompt chunk, a recompute, or the known run it extends by); returns the tokens taken."""
        pending = seq.num_pending
        known = len(seq.sample.ahead) + 1 if seq.sample is not None and seq.sample.ahead else 0
        if known and pending == known:  # only the known run is left: it extends (next step if no room)
            if budget > 0 and self.kv.ensure_slots(seq, known, self.margin()):
                batch.extend.append(seq)
                scheduled.add(id(seq))
                return known
            return 0
        take = min(pending - known, max(budget, 0), cap if cap is not None else budget)  # a recompute stops short of a known run
        if take <= 0:
            return 0
        if take == 1 and seq.num_pending == 1:
            batch.decode.append(seq)
        else:
            batch.chunks.append((seq, seq.num_computed, seq.num_computed + take))
        scheduled.add(id(seq))
        return take

    def _schedule_chunks(self, batch: ScheduledBatch, scheduled: set[int], more: list[Sequence], budget: int) -> int:
        """(b) Prompts being prefilled and samples being recomputed (unless preempted in (a)). While a
        waiting request can be admitted, a chunk takes at most an eighth of the budget left, so that a
        short request arriving beside a long prompt is admitted in (d) this step, in a step about as
        short as its own (its first token is then about a step away, not a long prompt's chunk).
        Returns the budget left."""
        cap = max(budget // WAITING_CHUNK_SHARE, self.kv.block_size) if self._newcomer_can_start() else None
        for seq in more:
            req = seq.request
            if seq is req.prompt_seq or (seq in req.running and id(seq) not in scheduled):
                budget -= self._add_chunk(batch, scheduled, seq, budget, cap)
        return budget

    def _newcomer_can_start(self) -> bool:
        """Whether one of the first waiting requests can be admitted this step: not deferred to an
        in-flight prefill of its prefix, and KV room for its prompt beside what running work keeps.
        Only then do running prompts' chunks give way (else the budget they leave would go unused)."""
        if not self.waiting:
            return False
        room = self.kv.room() - sum(len(r.running) + self._next_sample_blocks(r) for r in self.active)
        bs = self.kv.block_size
        for req in heapq.nsmallest(4, self.waiting, key=lambda r: r.arrival):  # the oldest, in one pass
            cached = self.kv.cached_prefix_len(req.prompt_ids)
            if not self._defer(req, cached) and -(-len(req.prompt_ids) // bs) - cached // bs <= room:
                return True
        return False

    def _start_pending_samples(self, batch: ScheduledBatch, scheduled: set[int], budget: int) -> int:
        """(c) Samples waiting for blocks or a row start (fresh samples of a request together, as
        one lane group), at most `max_num_seqs` running in all. Returns the budget left."""
        for req in self.active:
            slots = self.config.max_num_seqs - self.num_running
            if req.status is not Status.RUNNING or not req.pending or budget <= 0 or slots <= 0:
                continue
            todo = req.pending
            if req.beam is not None:
                # a beam whose log-probs are in waits for its siblings (no KV needed until the beam
                # step); the rest start together or not at all (a beam step needs every beam's row)
                todo = [st for st in req.pending if st not in req.beam.rows]
                # its waiting beams hold their slots: make room by preempting younger work, or wait
                while todo and len(todo) > slots and self._preempt_younger(req, scheduled):
                    slots = self.config.max_num_seqs - self.num_running
                if not todo or len(todo) > slots:
                    continue
            fresh = [st for st in todo if len(st.token_ids) == 1][: min(budget, slots)]
            if req.num_sequences > 1 and len(fresh) >= 2:
                for seq in self.kv.start_lane_group(req, fresh, self.margin()):
                    self._run(req, seq)
                    budget -= self._add_chunk(batch, scheduled, seq, budget)
            while req.status is Status.RUNNING and budget > 0 and self.num_running < self.config.max_num_seqs:
                if req.beam is None:
                    if not req.pending:
                        break
                    st = req.pending[0]
                else:
                    st = next((st for st in req.pending if st not in req.beam.rows), None)
                    if st is None:
                        break
                seq = self.kv.start_sample(req, st, self.margin())
                if seq is None:
                    # A request with nothing running must not wait on younger ones forever; nor a beam
                    # search, whose running beams wait for this one (a beam step needs them all).
                    if (not req.running or req.beam is not None) and self._preempt_younger(req, scheduled):
                        continue
                    break
                self._run(req, seq)
                budget -= self._add_chunk(batch, scheduled, seq, budget)
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, scheduled: set[int], budget: int) -> None:
        """(d) Admits waiting requests (in `_admission_order`) while budget is left, each taking its
        first prompt chunk; the rest wait one more step."""
        for req, cached in self._admission_order():
            if budget <= 0:
                break
            if self._defer(req, cached):
                continue
            if not self._admit(req):
                continue
            budget -= self._add_chunk(batch, scheduled, req.prompt_seq, budget)
        for req in self.waiting:
            req.waited_steps += 1

    def _speculate(self, batch: ScheduledBatch, budget: int) -> int:
        """Drafts for the decode rows (the speculator's), each drafted row becoming an extend of its
        pending token and its draft, with slots for all of them. Drafts take at most half the
        budget left (prefill chunks keep the rest) and never preempt: a sequence whose draft
        slots cannot be had decodes one token. Returns the rows added."""
        if self.speculator.drafter is not None:
            drafts = self._draft_with_model(batch, budget)
        else:
            drafts = self.speculator.propose(batch.decode, max(budget, 0) // 2)
        if not drafts:
            return 0
        added = 0
        moved: set[int] = set()
        for seq, draft in drafts:
            before = seq.blocks_before if self.speculator.drafter is not None else len(seq.block_table)
            if not self.kv.ensure_slots(seq, 1 + len(draft), self.margin()):
                self.kv.trim(seq, before)  # blocks taken on the way go back
                continue
            seq.tokens.extend(draft)
            seq.draft = draft
            seq.blocks_before = before
            batch.extend.append(seq)
            moved.add(id(seq))
            added += len(draft)
        if moved:
            batch.decode = [seq for seq in batch.decode if id(seq) not in moved]
        return added

    def _draft_with_model(self, batch: ScheduledBatch, budget: int) -> list[tuple[Sequence, list[int]]]:
        """A draft model writes KV for its draft tokens: their slots are reserved first (for the
        pending token and k draft tokens), then it drafts."""
        plan = []
        for seq, k in self.speculator.plan(batch.decode, max(budget, 0) // 2):
            before = len(seq.block_table)
            if not self.kv.ensure_slots(seq, 1 + k, self.margin()):
                self.kv.trim(seq, before)  # blocks taken on the way go back
                continue
            seq.blocks_before = before
            plan.append((seq, k))
        drafts = self.speculator.draft(plan)
        if not drafts:
            for seq, _ in plan:
                self.kv.trim(seq, seq.blocks_before)
        return drafts

    def _run(self, req: RequestState, seq: Sequence) -> None:
        req.pending.remove(seq.sample)
        req.running.append(seq)
        self.num_running += 1

    def run_forked(self, req: RequestState, seq: Sequence) -> None:
        """A beam's child forked from a running parent (`KVManager.fork_sequence`) runs."""
        req.running.append(seq)
        self.num_running += 1

    def sequence_done(self, seq: Sequence) -> None:
        """A running sequence left (finished or failed); its blocks are released by the caller."""
        req = seq.request
        if seq in req.running:
            req.running.remove(seq)
            self.num_running -= 1

    def prompt_done(self, req: RequestState) -> None:
        req.status = Status.RUNNING
        req.prompt_seq = None

    # ------------------------------------------------------------------ admission
    def _admission_order(self) -> list[tuple[RequestState, int | None]]:
        """Waiting requests in admission order, with their cached prefix length where it was looked up."""
        cfg = self.config
        if cfg.schedule == "fcfs" or not cfg.prefix_cache or len(self.waiting) > cfg.cache_aware_max_waiting:
            return [(r, None) for r in sorted(self.waiting, key=lambda r: r.arrival)]
        aged = sorted((r for r in self.waiting if r.waited_steps >= cfg.max_wait_steps), key=lambda r: r.arrival)
        rest = [r for r in self.waiting if r.waited_steps < cfg.max_wait_steps]
        matched = {id(r): self.kv.cached_prefix_len(r.prompt_ids) for r in rest}
        rest.sort(key=lambda r: (-matched[id(r)], r.arrival))
        return [(r, None) for r in aged] + [(r, matched[id(r)]) for r in rest]

    def _defer(self, req: RequestState, cached: int | None) -> bool:
        """Waits for an in-flight prefill of the same uncached prefix (then hits the cache)."""
        if not (self.config.defer_shared_prefill and self.config.prefix_cache):
            return False
        if req.waited_steps >= self.config.max_wait_steps:
            return False
        bs = self.kv.block_size
        if cached is None:
            cached = self.kv.cached_prefix_len(req.prompt_ids)
        for other in self.active:
            if other.status is not Status.PREFILLING:
                continue
            shared = _common_prefix(req.prompt_ids, other.prompt_ids)
            if shared // bs * bs > cached and shared >= bs:
                return True
        return False

    def _admit(self, req: RequestState) -> bool:
        # Leave room for every running sample's next block, so admission does not cause preemption.
        # Likewise one block per prefilling request and what each request's next sample needs.
        reserve = sum(len(r.running) + self._next_sample_blocks(r) for r in self.active)
        if not self.kv.admit_prompt(req, reserve, self.margin()):
            return False
        if req.admit_time is None:
            req.admit_time = time.perf_counter()
        self.metrics.prompt_tokens += len(req.prompt_ids)
        self.metrics.cached_prompt_tokens += req.cached_tokens
        req.prompt_seq = Sequence(req, list(req.prompt_ids), req.prompt_blocks, req.cached_tokens)
        req.status = Status.PREFILLING
        self.waiting.remove(req)
        self.active.append(req)
        self.active.sort(key=lambda r: r.arrival)
        return True

    def _next_sample_blocks(self, req: RequestState) -> int:
        if req.status is Status.PREFILLING:
            return 1
        if req.pending:
            bs = self.kv.block_size
            P = len(req.prompt_ids)
            # a beam search needs all its pending beams (a beam step waits for every one)
            waiting = req.pending if req.beam is not None else req.pending[:1]
            return sum(-(-(P + len(st.token_ids) + len(st.ahead)) // bs) - P // bs for st in waiting)
        return 0

    # ------------------------------------------------------------------ preemption
    def _ensure_slot(self, seq: Sequence, scheduled: set[int], count: int = 1) -> bool:
        """Slots for `seq`'s next `count` tokens, preempting younger work if needed; False if
        `seq` itself had to be preempted."""
        while not self.kv.ensure_slots(seq, count, self.margin()):
            if not self._preempt_one(seq, scheduled):
                self.preempt_sample(seq)
                return False
        return True

    def _preempt_one(self, for_seq: Sequence, scheduled: set[int]) -> bool:
        """Frees blocks from the youngest work that `for_seq` outranks; False if there is none."""
        mine = for_seq.request
        for victim in reversed(self.active):
            if victim.arrival < mine.arrival:
                break
            if victim.beam is not None and victim is not mine and not any(id(s) in scheduled for s in victim.running):
                self.preempt_request(victim)  # a beam search loses all its beams or none (each step needs them all)
                return True
            candidates = [s for s in victim.running if s is not for_seq and id(s) not in scheduled]
            if candidates:
                self.preempt_sample(candidates[-1])
                return True
            if victim is not mine:
                self.preempt_request(victim)
                return True
        return False

    def _preempt_younger(self, req: RequestState, scheduled: set[int]) -> bool:
        """Preempts the youngest request younger than `req` with nothing scheduled this step."""
        for victim in reversed(self.active):
            if victim.arrival <= req.arrival:
                return False
            busy = any(id(s) in scheduled for s in victim.running)
            if busy or (victim.prompt_seq is not None and id(victim.prompt_seq) in scheduled):
                continue
            self.preempt_request(victim)
            return True
        return False

    def preempt_sample(self, seq: Sequence) -> None:
        req = seq.request
        self.sequence_done(seq)
        self.kv.release_sequence(seq, cache=False)
        req.pending.insert(0, seq.sample)
        req.pending.sort(key=lambda s: s.index)
        self.metrics.preempted_samples += 1

    def preempt_request(self, req: RequestState) -> None:
        for seq in list(req.running):
            self.preempt_sample(seq)
        self.kv.release_prompt(req)
        req.pending = []
        req.prompt_seq = None
        req.status = Status.WAITING
        req.waited_steps = 0
        self.active.remove(req)
        self.waiting.append(req)
        self.metrics.preempted_requests += 1


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
