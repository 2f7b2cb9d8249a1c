"""The multi-request engine: paged KV, radix prefix cache, cache-aware continuous batching.

One `step()`:
  1. cancelled requests release their blocks;
  2. schedule (oldest request first): every running sample gets a slot for its next token
     (evicting cached prefixes, then preempting the youngest work if blocks run out); prompt
     chunks and resumed samples fill the rest of the token budget; then waiting requests are
     admitted in cache-aware order (longest cached prefix first, with an aging bound) or FCFS;
  3. one forward over all scheduled tokens (decode rows + prefill chunks), with every block
     shared by several decode rows read once for all of them (`attention/paged.py`);
  4. sample, stop checks, stream events; finished samples and requests release their blocks
     (their tokens stay in the prefix cache until evicted).

A request's `n` samples share its prompt blocks by reference count; each sample copies only the
prompt's partial last block. Samples start as blocks allow (waves for large n). A preempted
sample keeps its tokens and is recomputed on top of the still-pinned prompt blocks; a request
preempted entirely returns to the queue and finds its prompt in the prefix cache. Random draws
depend only on (seed, sample index, step), so results equal `LLM.sample`'s whatever the batch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forklm.attention.paged import DecodeRow, PagedAttention, StepPlanner
from forklm.cache.block_pool import BlockPool
from forklm.cache.paged_kv import PagedKVCache, kv_bytes_per_block
from forklm.cache.radix_cache import RadixCache
from forklm.device import available_memory_bytes
from forklm.engine.request import RequestState, Sequence, Status, TokenEvent
from forklm.engine.validation import EngineLimits, min_blocks, validate_request
from forklm.engine.sample_state import SampleState, check_finished, draw_rows, stop_token_set, to_sample
from forklm.errors import InvalidArgumentError, OutOfMemoryError
from forklm.models.llama import LlamaModel
from forklm.outputs import SampleOutput
from forklm.sampling.params import SamplingParams
from forklm.sampling.seeds import fresh_seed

SCHEDULES = ("cache-aware", "fcfs")
SHARED_ATTENTION = ("auto", "bifurcated", "standard")
DECODE_KERNELS = ("auto", "torch", "triton")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size; else from memory_budget
    memory_budget: int | None = None  # bytes of KV; default: memory_fraction of free memory
    memory_fraction: float = 0.25
    max_batch_tokens: int = 512  # tokens per forward: decode rows + prefill chunks
    prefix_cache: bool = True
    schedule: str = "cache-aware"  # or "fcfs"
    max_wait_steps: int = 256  # aging bound: a request waiting this many steps goes first
    shared_attention: str = "auto"  # per shared segment: measured rule, always, or never
    defer_shared_prefill: bool = True  # wait for a running prefill of the same prefix, then hit it
    decode_kernel: str = "auto"  # decode attention: "torch" (attend_segment per segment) or "triton" (one fused kernel)
    max_num_seqs: int = 256  # running sequences (decode rows) at most; more samples wait for a slot
    lane_ahead_tokens: int = 256  # a sample's own blocks are reserved this far ahead, as one run, while blocks are plentiful

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidArgumentError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise InvalidArgumentError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 1:
            raise InvalidArgumentError(f"max_batch_tokens must be an integer >= 1, got {self.max_batch_tokens!r}")
        if self.schedule not in SCHEDULES:
            raise InvalidArgumentError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.shared_attention not in SHARED_ATTENTION:
            raise InvalidArgumentError(f"shared_attention must be one of {SHARED_ATTENTION}, got {self.shared_attention!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise InvalidArgumentError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise InvalidArgumentError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.lane_ahead_tokens, int) or self.lane_ahead_tokens < 0:
            raise InvalidArgumentError(f"lane_ahead_tokens must be an integer >= 0, got {self.lane_ahead_tokens!r}")
        if not 0 < self.memory_fraction <= 1:
            raise InvalidArgumentError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")


@dataclass
class EngineMetrics:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (each admission)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model
    preempted_samples: int = 0
    preempted_requests: int = 0
    shared_reads: int = 0  # decode segment reads shared by several rows (bifurcated)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    """Drives many requests through one model. Not thread-safe: `EngineLoop` runs it on one thread."""

    def __init__(
        self,
        model: LlamaModel,
        decode: Callable[[list[int]], str],
        eos_token_ids: tuple[int, ...],
        config: EngineConfig | None = None,
        has_tokenizer: bool = True,
    ) -> None:
        self.model = model
        self.decode = decode
        self.eos_token_ids = eos_token_ids
        self.config = cfg = config or EngineConfig()
        per_block = kv_bytes_per_block(model.config, model.dtype, cfg.block_size)
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            budget = cfg.memory_budget or int(cfg.memory_fraction * available_memory_bytes(model.device))
            budget -= working_set_bytes(model.config, cfg)  # logits and sampler buffers of a full batch
            num_blocks = max(budget, 0) // per_block
            if num_blocks < 2:
                raise OutOfMemoryError(f"a KV memory budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes")
        self.block_size = cfg.block_size
        self.limits = EngineLimits(
            model.config.vocab_size, model.config.max_position_embeddings, has_tokenizer, num_blocks, cfg.block_size
        )
        self.decode_kernel = _resolve_decode_kernel(cfg.decode_kernel, model.device)
        self.pool = BlockPool(num_blocks, cfg.block_size)
        self.radix = RadixCache(self.pool)
        self.kv = PagedKVCache(model.config, num_blocks, cfg.block_size, model.dtype, model.device)
        self.planner = StepPlanner(
            cfg.block_size, cfg.shared_attention, model.device, self.decode_kernel,
            model.config.num_heads, model.config.num_kv_heads,
        )
        self.waiting: list[RequestState] = []
        self.active: list[RequestState] = []  # PREFILLING / RUNNING, in arrival order
        self.requests: dict[str, RequestState] = {}
        self.metrics = EngineMetrics()
        self._step_shared_reads = 0  # bifurcated shared-segment reads of the latest forward
        self._arrivals = itertools.count()
        self._lock = threading.Lock()  # guards cancel flags set from other threads

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_event: Callable[[TokenEvent], None] | None = None,
    ) -> RequestState:
        """Queues a request; raises InvalidArgumentError if it can never run."""
        self.validate_request(prompt_ids, params)
        order = next(self._arrivals)
        rid = request_id if request_id is not None else f"req-{order}"
        if rid in self.requests and self.requests[rid].status is not Status.FINISHED:
            raise InvalidArgumentError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else fresh_seed()
        req = RequestState(rid, list(prompt_ids), params, seed, order, on_event)
        req.samples = [SampleState(i) for i in range(params.n)]
        req.stats.prompt_tokens = len(prompt_ids)
        req.submit_time = time.perf_counter()
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidArgumentError unless the request can run here (`validation.py`). Reads only
        fixed configuration, so any thread may call it."""
        validate_request(prompt_ids, params, self.limits)

    def min_blocks(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks one request needs to make progress with a single sample."""
        return min_blocks(prompt_len, max_tokens, self.block_size)

    def cancel(self, request_id: str) -> bool:
        """Marks a request cancelled (any thread); its blocks are released at the next step."""
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.status is Status.FINISHED:
                return False
            req.cancelled = True
            return True

    def abort(self, request_id: str) -> bool:
        """Ends a request now, releasing its blocks (the engine's own thread only; see `cancel`)."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish_request(req, cancelled=True)
        return True

    def clear_prefix_cache(self) -> int:
        """Evicts every cached prefix no request is using; returns the blocks freed."""
        return self.radix.evict(self.radix.num_evictable_blocks) if self.config.prefix_cache else 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestState]:
        """One scheduling round and forward pass; returns the requests that finished in it."""
        finished: list[RequestState] = []
        with self._lock:
            cancelled = [r for r in self.waiting + self.active if r.cancelled]
        for req in cancelled:
            self._finish_request(req, cancelled=True)
            finished.append(req)
        decode, chunks = self._schedule()
        if not decode and not chunks:
            return finished
        self.metrics.steps += 1
        logits, row_of_seq = self._forward(decode, chunks)
        for req in self._sample(decode, chunks, logits, row_of_seq):
            finished.append(req)
        return finished

    def run(self) -> None:
        """Steps until every request has finished."""
        while self.has_unfinished():
            before = self.metrics.steps
            self.step()
            if self.metrics.steps == before and self.has_unfinished() and not self._any_cancel_pending():
                # Nothing could be scheduled: only possible if memory is held outside the engine.
                raise OutOfMemoryError("the engine cannot schedule any work: no KV blocks can be freed")

    def _any_cancel_pending(self) -> bool:
        return any(r.cancelled for r in self.waiting + self.active)

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int, int]]]:
        budget = self.config.max_batch_tokens
        decode: list[Sequence] = []
        scheduled: set[int] = set()  # id() of sequences already in this step
        # (a) every running sample with one pending token decodes; blocks first, oldest first
        for req in list(self.active):
            for seq in list(req.running):
                if seq.num_pending != 1 or seq not in req.running:
                    continue
                if self._ensure_capacity(seq, scheduled):
                    decode.append(seq)
                    scheduled.add(id(seq))
        budget -= len(decode)
        chunks: list[tuple[Sequence, int, int]] = []

        def add_chunk(seq: Sequence) -> None:
            nonlocal budget
            take = min(seq.num_pending, max(budget, 0))
            if take <= 0:
                return
            if take == 1 and seq.num_pending == 1:
                decode.append(seq)
            else:
                chunks.append((seq, seq.num_computed, seq.num_computed + take))
            scheduled.add(id(seq))
            budget -= take

        # (b) prompts being prefilled and samples being recomputed, oldest first
        for req in self.active:
            if req.status is Status.PREFILLING:
                add_chunk(req.prompt_seq)
            for seq in req.running:
                if seq.num_pending > 1 and id(seq) not in scheduled:
                    add_chunk(seq)
        # (c) samples waiting for blocks or a row (waves of a large n, preempted samples)
        slots = self.config.max_num_seqs - sum(len(r.running) for r in self.active)
        for req in self.active:
            if req.status is not Status.RUNNING or not req.pending or budget <= 0 or slots <= 0:
                continue
            for seq in self._start_lane_group(req, min(budget, slots)):
                req.pending.remove(seq.sample)
                req.running.append(seq)
                add_chunk(seq)
                slots -= 1
            while req.status is Status.RUNNING and req.pending and budget > 0 and slots > 0:
                seq = self._start_sample(req, req.pending[0])
                if seq is None:
                    # A request with nothing running must not wait on younger ones forever.
                    if not req.running and self._preempt_younger(req, scheduled):
                        continue
                    break
                req.pending.pop(0)
                req.running.append(seq)
                add_chunk(seq)
                slots -= 1
        # (d) admit waiting requests
        for req, cached in self._admission_order():
            if budget <= 0:
                break
            if self._defer(req, cached):
                continue
            if not self._admit(req):
                continue
            add_chunk(req.prompt_seq)
        for req in self.waiting:
            req.waited_steps += 1
        return decode, chunks

    def _admission_order(self) -> list[tuple[RequestState, int | None]]:
        """Waiting requests in admission order, with their cached prefix length where it was looked up."""
        if self.config.schedule == "fcfs" or not self.config.prefix_cache:
            return [(r, None) for r in sorted(self.waiting, key=lambda r: r.arrival)]
        aged = sorted((r for r in self.waiting if r.waited_steps >= self.config.max_wait_steps), key=lambda r: r.arrival)
        rest = [r for r in self.waiting if r.waited_steps < self.config.max_wait_steps]
        matched = {id(r): self.radix.match_prefix(r.prompt_ids).num_tokens for r in rest}
        rest.sort(key=lambda r: (-matched[id(r)], r.arrival))
        return [(r, None) for r in aged] + [(r, matched[id(r)]) for r in rest]

    def _defer(self, req: RequestState, cached: int | None) -> bool:
        """Waits for an in-flight prefill of the same uncached prefix (then hits the cache)."""
        if not (self.config.defer_shared_prefill and self.config.prefix_cache):
            return False
        if req.waited_steps >= self.config.max_wait_steps:
            return False
        bs = self.block_size
        if cached is None:
            cached = self.radix.match_prefix(req.prompt_ids).num_tokens
        for other in self.active:
            if other.status is not Status.PREFILLING:
                continue
            shared = _common_prefix(req.prompt_ids, other.prompt_ids)
            if shared // bs * bs > cached and shared >= bs:
                return True
        return False

    def _admit(self, req: RequestState) -> bool:
        """Takes blocks for the whole prompt (cached prefix by reference); False if they do not fit."""
        bs = self.block_size
        prompt = req.prompt_ids
        matched_blocks: list[int] = []
        node = None
        if self.config.prefix_cache:
            m = self.radix.match_prefix(prompt)
            node, matched_blocks = m.node, list(m.blocks)
            self.radix.lock(node)
            self.pool.incref(matched_blocks)
        need = -(-len(prompt) // bs) - len(matched_blocks)
        new = None
        if req.params.n == 1:  # the sample continues in the prompt's blocks: reserve its lane with them
            P = len(prompt)
            lane = self._lane_blocks(req, P, P + 1) + P // bs - len(matched_blocks)
            if self.pool.num_free >= lane + sum(len(r.running) + 1 for r in self.active):
                new = self.pool.allocate_run(lane)
        # Leave room for every running sample's next block, so admission does not cause preemption.
        # Likewise one block per prefilling request and what each request's next sample needs.
        reserve = sum(len(r.running) + self._next_sample_blocks(r) for r in self.active)
        room = self.pool.num_free + (self.radix.num_evictable_blocks if self.config.prefix_cache else 0)
        if new is None:
            new = self._allocate(need) if need + reserve <= room else None
        if new is None:
            if node is not None:
                self.pool.decref(matched_blocks)
                self.radix.unlock(node)
            return False
        req.locked_node = node
        if req.admit_time is None:
            req.admit_time = time.perf_counter()
        req.prompt_blocks = matched_blocks + new
        num_cached = len(matched_blocks) * bs
        req.cached_tokens = num_cached
        self.metrics.prompt_tokens += len(prompt)
        self.metrics.cached_prompt_tokens += num_cached
        req.prompt_seq = Sequence(req, list(prompt), req.prompt_blocks, num_cached)
        req.status = Status.PREFILLING
        self.waiting.remove(req)
        self.active.append(req)
        self.active.sort(key=lambda r: r.arrival)
        return True

    def _next_sample_blocks(self, req: RequestState) -> int:
        if req.status is Status.PREFILLING:
            return 1
        if req.pending:
            bs = self.block_size
            P = len(req.prompt_ids)
            return -(-(P + len(req.pending[0].token_ids)) // bs) - P // bs
        return 0

    def _allocate(self, n: int) -> list[int] | None:
        """`n` blocks, evicting cached prefixes if that makes enough room; None (nothing evicted) if not."""
        if n == 0:
            return []
        blocks = self.pool.allocate(n)
        if blocks is None and self.config.prefix_cache:
            if self.pool.num_free + self.radix.num_evictable_blocks < n:
                return None
            self.radix.evict(n - self.pool.num_free)
            blocks = self.pool.allocate(n)
        return blocks

    def _ensure_capacity(self, seq: Sequence, scheduled: set[int]) -> bool:
        """Gives `seq` a slot for its next token, preempting younger work if needed.

        Returns False if `seq` itself had to be preempted.
        """
        if seq.num_computed < len(seq.block_table) * self.block_size:
            return True
        ahead = self._lane_blocks(seq.request, seq.num_computed, seq.num_computed + 1)
        if ahead > 1:
            blocks = self.pool.allocate_at(seq.block_table[-1] + 1, ahead) or self.pool.allocate_run(ahead)
            if blocks is not None:
                seq.block_table.extend(blocks)
                return True
        while True:
            last = seq.block_table[-1] if seq.block_table else -2
            blocks = self.pool.allocate_at(last + 1, 1) or self._allocate(1)
            if blocks is not None:
                seq.block_table.extend(blocks)
                return True
            if not self._preempt_one(seq, scheduled):
                self._preempt_sample(seq)
                return False

    def _preempt_one(self, for_seq: Sequence, scheduled: set[int]) -> bool:
        """Frees blocks from the youngest work that `for_seq` outranks; False if there is none."""
        mine = for_seq.request
        for victim in reversed(self.active):
            if victim.arrival < mine.arrival:
                break
            candidates = [s for s in victim.running if s is not for_seq and id(s) not in scheduled]
            if candidates:
                self._preempt_sample(candidates[-1])
                return True
            if victim is not mine:
                self._preempt_request(victim)
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
            self._preempt_request(victim)
            return True
        return False

    def _preempt_sample(self, seq: Sequence) -> None:
        req = seq.request
        req.running.remove(seq)
        self.pool.decref(seq.block_table)
        req.pending.insert(0, seq.sample)
        req.pending.sort(key=lambda s: s.index)
        self.metrics.preempted_samples += 1

    def _preempt_request(self, req: RequestState) -> None:
        for seq in list(req.running):
            self._preempt_sample(seq)
        self._release_prompt(req)
        req.pending = []
        req.prompt_seq = None
        req.status = Status.WAITING
        req.waited_steps = 0
        self.active.remove(req)
        self.waiting.append(req)
        self.metrics.preempted_requests += 1

    def _release_prompt(self, req: RequestState) -> None:
        if req.prompt_blocks:
            self.pool.decref(req.prompt_blocks)
            req.prompt_blocks = []
        if req.locked_node is not None:
            self.radix.unlock(req.locked_node)
            req.locked_node = None

    def _lane_blocks(self, req: RequestState, start: int, min_end: int, rows: int = 1) -> int:
        """Blocks per row for a row whose next block holds token `start` and that needs slots up
        to token `min_end` now: up to `lane_ahead_tokens` further (never past the request's last
        token) while the pool has room for that beside one block per running sequence; else
        just enough for `min_end` (lazy growth, as under memory pressure)."""
        bs = self.block_size
        first = start // bs
        need = max(1, -(-min_end // bs) - first)
        end = min(len(req.prompt_ids) + req.params.max_tokens, start + self.config.lane_ahead_tokens)
        ahead = -(-end // bs) - first
        if ahead <= need:
            return need
        margin = sum(len(r.running) + 1 for r in self.active)
        return ahead if self.pool.num_free >= rows * ahead + margin else need

    def _start_lane_group(self, req: RequestState, limit: int) -> list[Sequence]:
        """Starts fresh samples of `req` (one token each, none computed) together as one lane
        group: each owns a run of K blocks, the runs side by side, so that their tails are one
        strided view (`attention/paged.py`). Empty when the request is n = 1, fewer than two
        such samples are pending, or no run of that size is free."""
        bs = self.block_size
        P = len(req.prompt_ids)
        fresh = [st for st in req.pending if len(st.token_ids) == 1][: max(limit, 0)]
        if req.params.n == 1 or len(fresh) < 2:
            return []
        full, rem = divmod(P, bs)
        k = self._lane_blocks(req, P, P + 1, len(fresh))
        run = self.pool.allocate_run(len(fresh) * k)
        if run is None:
            return []
        shared = req.prompt_blocks[:full]
        seqs = []
        for i, st in enumerate(fresh):
            own = run[i * k : (i + 1) * k]
            self.pool.incref(shared)
            seqs.append(Sequence(req, req.prompt_ids + st.token_ids, shared + own, P, st))
        if rem:
            src = req.prompt_blocks[full] * bs
            self.kv.copy_slots(
                [src + j for _ in fresh for j in range(rem)],
                [run[i * k] * bs + j for i in range(len(fresh)) for j in range(rem)],
            )
        return seqs

    def _start_sample(self, req: RequestState, st: SampleState) -> Sequence | None:
        """A sequence for a sample that has tokens but no KV: the prompt's full blocks shared, the
        partial last block copied, blocks for its own tokens allocated (computed by the next chunk).
        A request of one sample shares all its prompt blocks (the partial one and the blocks
        reserved after it at admission: one run for the whole sequence)."""
        bs = self.block_size
        P = len(req.prompt_ids)
        full, rem = divmod(P, bs)
        tokens = req.prompt_ids + st.token_ids
        if req.params.n == 1:
            table = list(req.prompt_blocks)
            need = -(-len(tokens) // bs) - len(table)
            new = []
            if need > 0:
                new = self.pool.allocate_at(table[-1] + 1, need) if table else None
                new = new or self._allocate(need)
                if new is None:
                    return None
            self.pool.incref(table)
            return Sequence(req, tokens, table + new, P, st)
        need = -(-len(tokens) // bs) - full
        lane = self._lane_blocks(req, full * bs, len(tokens))
        new = self.pool.allocate_run(lane) if lane > need else None
        if new is None:
            new = self._allocate(need)
        if new is None:
            return None
        shared = req.prompt_blocks[:full]
        self.pool.incref(shared)
        if rem:
            src = req.prompt_blocks[full] * bs
            self.kv.copy_slots(range(src, src + rem), range(new[0] * bs, new[0] * bs + rem))
        return Sequence(req, tokens, shared + new, P, st)

    # ------------------------------------------------------------------ forward
    def _forward(
        self, decode: list[Sequence], chunks: list[tuple[Sequence, int, int]]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        dev = self.model.device
        ids: list[int] = []
        pos: list[int] = []
        logits_rows: list[int] = []
        row_of_seq: dict[int, int] = {}  # id(seq) -> row of its logits
        for seq in decode:
            t = seq.num_computed
            row_of_seq[id(seq)] = len(logits_rows)
            logits_rows.append(len(ids))
            ids.append(seq.tokens[t])
            pos.append(t)
        for seq, s0, s1 in chunks:
            ids.extend(seq.tokens[s0:s1])
            pos.extend(range(s0, s1))
            if s1 == len(seq.tokens):
                row_of_seq[id(seq)] = len(logits_rows)
                logits_rows.append(len(ids) - 1)
        plan = self.planner.plan(
            [DecodeRow(seq.block_table, seq.num_computed, len(seq.request.prompt_ids) // self.block_size, seq)
             for seq in decode],
            [(seq.block_table, s0, s1) for seq, s0, s1 in chunks],
        )
        self.metrics.shared_reads += plan.num_shared_reads
        self._step_shared_reads = plan.num_shared_reads
        self.metrics.computed_tokens += len(ids)
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            PagedAttention(self.kv, plan),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        for seq, s0, s1 in chunks:
            seq.num_computed = s1
        for seq in decode:
            seq.num_computed += 1
        return logits, row_of_seq

    # ------------------------------------------------------------------ sampling and bookkeeping
    def _sample(
        self,
        decode: list[Sequence],
        chunks: list[tuple[Sequence, int, int]],
        logits: torch.Tensor,
        row_of_seq: dict[int, int],
    ) -> list[RequestState]:
        """Draws every sample's next token in one batch; stop checks, events, releases."""
        rows: list[int] = []  # logits row of each drawn state
        states: list[SampleState] = []
        seqs: list[Sequence | None] = []  # None: a sample's first token, from its prompt's logits
        owner: list[RequestState] = []  # the request of each drawn state
        touched: dict[int, RequestState] = {}
        prompts_done: list[RequestState] = []
        for seq in decode + [c[0] for c in chunks]:
            if id(seq) not in row_of_seq:
                continue
            req = seq.request
            touched[id(req)] = req
            if seq.sample is None:
                self._prompt_done(req)
                prompts_done.append(req)
                fresh = [st for st in req.samples if not st.token_ids]
                rows += [row_of_seq[id(seq)]] * len(fresh)
                states += fresh
                seqs += [None] * len(fresh)
                owner += [req] * len(fresh)
            else:
                rows.append(row_of_seq[id(seq)])
                states.append(seq.sample)
                seqs.append(seq)
                owner.append(req)
        now = time.perf_counter()
        if states:
            stop_sets = {id(r): stop_token_set(r.params, self.eos_token_ids) for r in touched.values()}
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            draw_rows(
                logits.index_select(0, idx),
                states,
                [r.params for r in owner],
                [r.seed for r in owner],
                [stop_sets[id(r)] for r in owner],
            )
            done = [check_finished(st, r.params, stop_sets[id(r)], self.decode) for st, r in zip(states, owner)]
            for seq, st, fin in zip(seqs, states, done):
                if seq is not None and not fin:
                    seq.tokens.append(st.token_ids[-1])
            counted: set[int] = set()
            path = "bifurcated" if self._step_shared_reads else "standard"
            for r in owner:
                if r.first_token_time is None:
                    r.first_token_time = now
                r.stats.generated_tokens += 1
                if id(r) not in counted:
                    counted.add(id(r))
                    if r.last_step_time is not None:  # a decode step (the first tokens come from the prefill's)
                        r.stats.steps += 1
                        r.stats.path_steps[path] = r.stats.path_steps.get(path, 0) + 1
                        r.stats.step_s.append(now - r.last_step_time)
                    r.last_step_time = now
            for st, r, fin in zip(states, owner, done):
                event = TokenEvent(
                    r.request_id, st.index, st.token_ids[-1], st.logprobs[-1], st.finish_reason if fin else None,
                    top_logprobs=st.top_logprobs[-1] if st.top_logprobs else None,
                    sample=to_sample(st, self.decode) if fin else None,
                )
                self._emit(r, event)
            for seq, fin in zip(seqs, done):
                if seq is not None and fin:
                    self._release_sequence(seq)
        for req in prompts_done:
            req.pending = [st for st in req.samples if not st.finished]
        finished: list[RequestState] = []
        for req in touched.values():
            if req.status is not Status.FINISHED and not req.unfinished_samples:
                self._finish_request(req)
                finished.append(req)
        return finished

    def _emit(self, req: RequestState, event: TokenEvent) -> None:
        """Calls the request's callback; one that raises is dropped (the request still runs)."""
        if req.on_event is None:
            return
        try:
            req.on_event(event)
        except Exception:  # noqa: BLE001 - a consumer's failure must not break the engine
            req.on_event = None

    def _prompt_done(self, req: RequestState) -> None:
        """The prompt's KV is complete: cache it at once, so siblings and other requests hit it."""
        req.status = Status.RUNNING
        req.prompt_seq = None
        if not self.config.prefix_cache:
            return
        bs = self.block_size
        full = len(req.prompt_ids) // bs
        duplicates = self.radix.insert(req.prompt_ids[: full * bs], req.prompt_blocks[:full])
        m = self.radix.match_prefix(req.prompt_ids, max_tokens=full * bs)
        node = m.node
        self.radix.lock(node)
        if duplicates:
            # The tree already held some of these blocks (another request prefilled the same
            # tokens meanwhile, or the last block was recomputed): use the tree's, free ours.
            self.pool.incref(m.blocks)
            self.pool.decref(req.prompt_blocks[:full])
            req.prompt_blocks = list(m.blocks) + req.prompt_blocks[full:]
        if req.locked_node is not None:
            self.radix.unlock(req.locked_node)
        req.locked_node = node

    def _release_sequence(self, seq: Sequence) -> None:
        """A finished sample: its computed full blocks join the prefix cache, its references go."""
        req = seq.request
        if self.config.prefix_cache:
            full = seq.num_computed // self.block_size
            self.radix.insert(seq.tokens[: full * self.block_size], seq.block_table[:full])
        self.pool.decref(seq.block_table)
        req.running.remove(seq)

    def _finish_request(self, req: RequestState, cancelled: bool = False) -> None:
        for seq in list(req.running):
            self.pool.decref(seq.block_table)
        req.running = []
        req.pending = []
        req.prompt_seq = None
        self._release_prompt(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.active:
            self.active.remove(req)
        if cancelled:
            for st in req.samples:
                if not st.finished:
                    st.finish_reason = "cancelled"
        req.status = Status.FINISHED
        self.requests.pop(req.request_id, None)
        now = time.perf_counter()
        first = req.first_token_time if req.first_token_time is not None else now
        admitted = req.admit_time if req.admit_time is not None else first
        req.stats.queue_s = admitted - req.submit_time  # submitted -> first admitted
        req.stats.prefill_s = first - admitted  # admitted -> first token (prefill, and preemptions)
        req.stats.decode_s = now - first
        req.stats.cached_prompt_tokens = req.cached_tokens
        out = SampleOutput(
            prompt_token_ids=list(req.prompt_ids),
            samples=[to_sample(st, self.decode) for st in req.samples],
            seed=req.seed,
            stats=req.stats,
        )
        req.output = out
        self._emit(req, TokenEvent(req.request_id, done=True, output=out))

    # ------------------------------------------------------------------ checks
    def holders(self) -> dict[object, list[int]]:
        """Every block reference the engine's requests and sequences hold (for integrity checks)."""
        out: dict[object, list[int]] = {}
        for req in self.active:
            out[("prompt", req.request_id)] = list(req.prompt_blocks)
            for seq in req.running:
                out[("sample", req.request_id, seq.sample.index)] = list(seq.block_table)
        return out

    def check_integrity(self) -> None:
        self.radix.check_integrity(self.holders())

    def blocks_in_use(self) -> int:
        return self.pool.num_in_use


def working_set_bytes(config, cfg: EngineConfig) -> int:
    """Per-step buffers that grow with the batch: float32 logits of every decode row and the
    sampler's temporaries (softmax, filtered copies: ~4 rows of the vocabulary per row)."""
    rows = min(cfg.max_num_seqs + 1, cfg.max_batch_tokens + cfg.max_num_seqs)
    return rows * config.vocab_size * 4 * 5


def _resolve_decode_kernel(choice: str, device: torch.device) -> str:
    from forklm.kernels.segment_attention import available

    if choice == "auto":
        # The Triton kernel is checked in Triton's interpreter only; it becomes the CUDA default once
        # it has been checked and timed on a GPU (issue 6).
        return "torch"
    if choice == "triton" and not available():
        raise InvalidArgumentError("decode_kernel='triton' needs the triton package (pip install triton)")
    return choice


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
