"""The engine: many requests, one model, one paged KV cache. `step()` reads in a few lines.

    step():  cancelled requests end -> the scheduler picks the step's work -> the model runner
             runs one forward -> the output processor draws, checks stops and emits events ->
             finished samples and requests release their blocks through the KV manager.

Owners, one file each: `scheduler.py` (policy: admission order, chunked prefill budget, waves,
preemption victims, `max_num_seqs`), `kv_manager.py` (the only code touching block reference
counts and the radix prefix cache), `model_runner.py` (input tensors, attention plan, forward),
`output_processor.py` (the draw, stop rules, events), `validation.py` (request checks).

A request's `n` samples share its prompt blocks by reference count; fresh samples start together
as one lane group (their own blocks side by side, so the decode step reads their tails as one
strided view; nothing of the context is copied). Samples start as blocks allow (waves for a
large n). A preempted sample keeps its tokens and is recomputed on top of the still-pinned prompt
blocks; a request preempted entirely returns to the queue and finds its prompt in the prefix
cache. Random draws depend only on (seed, sample index, position), so results equal the
reference single-request path's whatever the batch.

A failure in any phase of a step (forward, draw, stop checks, prefix insertion) fails only the
requests of that step (only the request concerned where it is one request's: a stop check or
decode), releases their blocks, and the engine checks its integrity afterwards.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from forklm.attention.paged import StepPlanner
from forklm.backend import DECODE_KERNELS
from forklm.cache.paged_kv import PagedKVCache, kv_bytes_per_block
from forklm.device import available_memory_bytes
from forklm.engine.kv_manager import KVManager
from forklm.engine.model_runner import ModelRunner
from forklm.engine.output_processor import OutputProcessor, StepResult, emit
from forklm.engine.request import RequestState, Status, TokenEvent
from forklm.engine.scheduler import Scheduler
from forklm.engine.validation import EngineLimits, min_blocks, validate_request
from forklm.errors import InvalidArgumentError, OutOfMemoryError
from forklm.models.llama import LlamaModel
from forklm.outputs import SampleOutput
from forklm.sampling.constraints import token_constraints
from forklm.sampling.beam import BeamSearch
from forklm.sampling.params import SamplingParams
from forklm.sampling.sample_state import SampleState, to_sample
from forklm.sampling.seeds import fresh_seed
from forklm.speculative.config import SpeculativeConfig
from forklm.speculative.draft_model import DraftModelDrafter, check_same_vocabulary, load_draft_model
from forklm.speculative.speculator import Speculator

SCHEDULES = ("cache-aware", "fcfs")
SHARED_ATTENTION = ("auto", "bifurcated", "standard")
KV_DTYPES = ("auto", "model", "float16")
KV_LAYOUTS = ("kv", "el")


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
    cache_aware_max_waiting: int = 128  # more waiting requests than this: FCFS (ordering stays cheap)
    shared_attention: str = "auto"  # per shared segment: measured rule, always, or never
    defer_shared_prefill: bool = True  # wait for a running prefill of the same prefix, then hit it
    # decode attention: "torch" (a PyTorch product per segment), "triton" (one fused kernel) or "cpu" (one
    # C++ call per layer: float32 models on AVX2 CPUs); "auto": "cpu" where it runs, else "torch"
    decode_kernel: str = "auto"
    # the KV cache's dtype: "model" (the model's), "float16" (half the bytes to read a step: float32
    # models on the "cpu" decode kernel only) or "auto": float16 where that kernel runs a model with
    # quantized weights (already an approximation; as llama.cpp's default cache), else the model's
    kv_dtype: str = "auto"
    # what the pool holds per token and layer: "kv" (keys and values) or "el" (EL-attention: the attention's
    # input hidden state, for models without rotary positions: GPT-2 / GPT-BigCode; models/gpt2.py)
    kv_layout: str = "kv"
    max_num_seqs: int = 256  # running sequences (decode rows) at most; more samples wait for a slot
    lane_ahead_tokens: int = 256  # a sample's own blocks are reserved this far ahead, as one run, while blocks are plentiful
    # speculative sampling (README "Speculative sampling"): None (off), a method name ("ngram"), a
    # dict of `SpeculativeConfig` fields ({"method": "draft", "draft_model": ...}), or a SpeculativeConfig
    speculative: SpeculativeConfig | dict | str | None = None

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
        if self.kv_layout not in KV_LAYOUTS:
            raise InvalidArgumentError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidArgumentError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise InvalidArgumentError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.lane_ahead_tokens, int) or self.lane_ahead_tokens < 0:
            raise InvalidArgumentError(f"lane_ahead_tokens must be an integer >= 0, got {self.lane_ahead_tokens!r}")
        if not 0 < self.memory_fraction <= 1:
            raise InvalidArgumentError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        self.speculative = SpeculativeConfig.from_any(self.speculative)


@dataclass
class EngineMetrics:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (each admission)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model
    preempted_samples: int = 0
    preempted_requests: int = 0
    shared_reads: int = 0  # decode segment reads shared by several rows (bifurcated)
    extends: int = 0  # multi-token extends run (a sample's drawn token and its known run in one step)
    extend_tokens: int = 0  # tokens computed in them
    speculative: object = None  # SpeculativeMetrics when the engine speculates (acceptance, tokens per step, times)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def cache_config(model, cfg: EngineConfig):
    """The model config the pool is laid out by: the model's own (K/V), or its EL-attention form."""
    if cfg.kv_layout == "kv":
        return model.config
    el = getattr(model.config, "el_cache_config", None)
    if el is None:
        raise InvalidArgumentError(
            f"kv_layout 'el' (EL-attention) needs a model whose keys are a product of the hidden state alone "
            f"(GPT-2, GPT-BigCode); {model.config.architecture} rotates its keys by position (rotary), so W_K "
            "cannot move to the query side")
    if cfg.speculative is not None and cfg.speculative.method == "draft":
        raise InvalidArgumentError("kv_layout 'el' with a draft model is not supported")
    return el()


def pool_blocks(model: LlamaModel, cfg: EngineConfig, kv_dtype, draft_model=None) -> int:
    """KV blocks of the pool: the config's `num_blocks`, else as many as the memory budget holds
    (every block with its twin in a draft model's KV); OutOfMemoryError below 2."""
    per_block = kv_bytes_per_block(cache_config(model, cfg), kv_dtype, cfg.block_size)
    if draft_model is not None:  # every block has a twin in the draft's KV
        per_block += kv_bytes_per_block(draft_model.config, draft_model.dtype, cfg.block_size)
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    budget = cfg.memory_budget or int(cfg.memory_fraction * available_memory_bytes(model.device))
    budget -= working_set_bytes(model.config, cfg)  # logits and sampler buffers of a full batch
    num_blocks = max(budget, 0) // per_block
    if num_blocks < 2:
        raise OutOfMemoryError(f"a KV memory budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes")
    return num_blocks


class Engine:
    """Drives many requests through one model. Not thread-safe: `EngineLoop` runs it on one thread
    (`cancel` and `validate_request` may be called from any thread)."""

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
        spec = cfg.speculative
        draft_model = None
        if spec is not None and spec.method == "draft":  # loaded (if named) and checked before anything is built
            tokenizer = getattr(decode, "__self__", None)
            draft_model, draft_tokenizer = load_draft_model(spec.draft_model, model.backend)
            check_same_vocabulary(model, tokenizer if has_tokenizer else None, draft_model, draft_tokenizer)
        self.decode_kernel = model.backend.engine_decode_kernel(cfg.decode_kernel)
        if cfg.kv_layout == "el" and self.decode_kernel == "cpu":
            from forklm.backend import cpu_attention_error

            why = cpu_attention_error(model.dtype, model.device, model.config.hidden_size)
            if why is not None and cfg.decode_kernel == "cpu":
                raise InvalidArgumentError(f"decode_kernel 'cpu' cannot run EL-attention's hidden-state pool: {why}")
            if why is not None:
                self.decode_kernel = "torch"  # the C++ kernel takes head dims that are multiples of 16
        if model.device.type == "cpu":  # the step's other C++ parts built now (once per machine), not on a request
            from forklm.kernels import cpu_sampler

            cpu_sampler.available()
            if self.decode_kernel == "cpu":
                model.prepare_decode_stack()
        self.kv_dtype = model.backend.kv_dtype(cfg.kv_dtype, self.decode_kernel)
        num_blocks = pool_blocks(model, cfg, self.kv_dtype, draft_model)
        self.block_size = cfg.block_size
        self.limits = EngineLimits(
            model.config.vocab_size, model.config.max_position_embeddings, has_tokenizer, num_blocks, cfg.block_size,
            cfg.max_num_seqs,
        )
        pool_config = cache_config(model, cfg)
        self.kv = PagedKVCache(pool_config, num_blocks, cfg.block_size, self.kv_dtype, model.device)
        self.kv_manager = KVManager(self.kv, num_blocks, cfg.block_size, cfg.prefix_cache, cfg.lane_ahead_tokens)
        self.pool, self.radix = self.kv_manager.pool, self.kv_manager.radix
        self.metrics = EngineMetrics()
        drafter = None
        if draft_model is not None:
            draft_kernel = self.decode_kernel if self.decode_kernel != "cpu" else draft_model.backend.decode_kernel
            drafter = DraftModelDrafter(draft_model, num_blocks, cfg.block_size, cfg.shared_attention, draft_kernel,
                                        model.config.vocab_size, spec.draft_temperature, spec.draft_top_p)
            self.kv_manager.draft_kv = drafter.kv
        self.drafter = drafter
        self.speculator = Speculator(cfg.speculative, drafter) if cfg.speculative is not None else None
        self.metrics.speculative = self.speculator.metrics if self.speculator is not None else None
        self.scheduler = Scheduler(cfg, self.kv_manager, self.metrics, self.speculator)
        planner = StepPlanner(
            cfg.block_size, cfg.shared_attention, model.device, self.decode_kernel,
            pool_config.num_heads, pool_config.num_kv_heads, self.kv.num_slots,
        )
        self.runner = ModelRunner(model, self.kv, planner)
        self.output = OutputProcessor(decode, eos_token_ids, self.speculator)
        self.requests: dict[str, RequestState] = {}
        self._arrivals = itertools.count()
        self._lock = threading.Lock()  # guards cancel flags set from other threads
        self._cancels = 0  # cancel() calls not yet acted on (so a step scans for them only then)
        self._deadlines = 0  # requests with a time budget not yet finished (a step checks them only then)

    @property
    def waiting(self) -> list[RequestState]:
        return self.scheduler.waiting

    @property
    def active(self) -> list[RequestState]:
        return self.scheduler.active

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
        if params.beam_width:
            req.beam = BeamSearch(params)
            req.samples = list(req.beam.live)  # one beam per group: the prompt
        else:
            req.samples = [SampleState(i) for i in range(params.n)]
        req.stats.prompt_tokens = len(prompt_ids)
        req.submit_time = time.perf_counter()
        if params.time_budget_s is not None:
            req.deadline = req.submit_time + params.time_budget_s
            self._deadlines += 1
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidArgumentError unless the request can run here (`validation.py`). Reads only
        fixed configuration, so any thread may call it."""
        validate_request(prompt_ids, params, self.limits)
        if params.constraint is not None and self.output.tokenizer is not None:  # before anything is queued
            token_constraints(self.output.tokenizer, self.output.eos_token_ids).check(params.constraint)

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
            self._cancels += 1
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
        return self.kv_manager.clear_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestState]:
        """One scheduling round and forward pass; returns the requests that ended in it."""
        t0 = time.perf_counter()
        finished = self._end_cancelled()
        batch = self.scheduler.schedule()
        if batch.empty:
            return finished
        self.metrics.steps += 1
        if batch.extend:
            known = [seq for seq in batch.extend if not seq.draft]  # drafts are counted by the speculator
            self.metrics.extends += len(known)
            self.metrics.extend_tokens += sum(seq.num_pending for seq in known)
        self.output.prepare(batch)  # grammar masks on a worker thread while the model runs
        try:
            out = self.runner.run(batch)
        except Exception as exc:  # noqa: BLE001 - the forward failed: this step's requests fail
            self.output.wait()
            return finished + self._fail_requests({id(r): (r, exc) for r in batch.requests()})
        if self.drafter is not None:  # the draft computes the prompt (and recompute) tokens the target did
            t1 = time.perf_counter()
            try:
                self.drafter.mirror([(seq, s0) for seq, s0, _ in batch.chunks]
                                    + [(seq, seq.num_computed - 1) for seq in batch.decode if seq.sample is None])
            except Exception as exc:  # noqa: BLE001 - the draft's forward failed: this step's requests fail
                self.output.wait()
                return finished + self._fail_requests({id(r): (r, exc) for r in batch.requests()})
            finally:
                self.speculator.metrics.draft_s += time.perf_counter() - t1
        self.metrics.computed_tokens += out.num_tokens
        self.metrics.shared_reads += out.shared_reads
        result = self.output.process(batch, out)
        ended = finished + self._apply(result)
        if self.speculator is not None and not batch.chunks:  # the cost rule times decode steps only
            self.speculator.observe_step(out.num_tokens, time.perf_counter() - t0)
        return ended

    def run(self) -> None:
        """Steps until every request has finished."""
        while self.has_unfinished():
            before = self.metrics.steps
            self.step()
            if self.metrics.steps == before and self.has_unfinished() and not self._any_cancel_pending():
                # Nothing could be scheduled: only possible if memory is held outside the engine.
                raise OutOfMemoryError("the engine cannot schedule any work: no KV blocks can be freed")

    def _any_cancel_pending(self) -> bool:
        return self._cancels > 0

    def _end_cancelled(self) -> list[RequestState]:
        """Ends cancelled requests, and those past their time budget's deadline (their unfinished
        samples end with finish_reason "time", keeping their tokens), before the step's work."""
        if not self._cancels and not self._deadlines:  # read without the lock: a racing cancel is seen next step
            return []
        now = time.perf_counter()
        with self._lock:
            self._cancels = 0
            ended = [r for r in self.waiting + self.active
                     if r.cancelled or (r.deadline is not None and now >= r.deadline)]
        for req in ended:
            self._finish_request(req, cancelled=True, reason="cancelled" if req.cancelled else "time")
        return ended

    def _apply(self, result: StepResult) -> list[RequestState]:
        """Hands the step's outcome to the KV manager and ends finished and failed requests."""
        failed = result.failed
        cfg = self.config
        for seq in result.rolled_back:  # verified drafts: blocks taken only for rejected tokens go back
            if id(seq.request) in failed or not seq.block_table:
                continue
            keep = max(seq.blocks_before, -(-(seq.num_computed + 1) // self.block_size))
            if self.kv_manager.trim(seq, keep):
                self.runner.forget(seq)  # the planner's cached tail runs may list freed blocks
        for req in result.prompts_done:
            if id(req) in failed:
                continue
            self.scheduler.prompt_done(req)
            try:
                self.kv_manager.prompt_done(req)
            except Exception as exc:  # noqa: BLE001 - prefix insertion failed: this request fails
                failed.setdefault(id(req), (req, exc))
                continue
            req.pending = [st for st in req.samples if not st.finished]
        for seq in result.finished_seqs:
            if id(seq.request) in failed:
                continue
            self.scheduler.sequence_done(seq)
            self.runner.forget(seq)
            try:
                self.kv_manager.release_sequence(seq, cache=True)
            except Exception as exc:  # noqa: BLE001
                failed.setdefault(id(seq.request), (seq.request, exc))
        for parent, child in result.beam_forks:  # a beam's further children share its blocks (after the
            req = parent.request               # childless parents' release above)
            if id(req) in failed:
                continue
            seq = None
            if self.scheduler.num_running < cfg.max_num_seqs:
                try:
                    seq = self.kv_manager.fork_sequence(parent, child)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    failed.setdefault(id(req), (req, exc))
                    continue
            if seq is None:  # no block for its copy, or no row: computed like a preempted sample later
                req.pending.append(child)
                req.pending.sort(key=lambda st: st.index)
            else:
                self.scheduler.run_forked(req, seq)
        ended = self._fail_requests(failed)
        for req in result.sample_ended.values():  # only these can have run out of samples
            if req.status is not Status.FINISHED and not req.unfinished_samples:
                self._finish_request(req)
                ended.append(req)
        return ended

    def _fail_requests(self, failed: dict[int, tuple[RequestState, BaseException]]) -> list[RequestState]:
        """Ends each request with its error (blocks released, an error event), then checks the
        engine's bookkeeping: a failure must leave nothing half-done behind."""
        ended = []
        for req, exc in failed.values():
            if req.status is Status.FINISHED:
                continue
            self._release_request(req)
            req.error = exc
            for st in req.samples:
                if not st.finished:
                    st.finish_reason = "error"
            emit(req, TokenEvent(req.request_id, done=True, error=exc))
            ended.append(req)
        if failed:
            self.check_integrity()
        return ended

    # ------------------------------------------------------------------ request lifecycle
    def _release_request(self, req: RequestState) -> None:
        """Every block the request holds goes back; it leaves the queues."""
        for seq in list(req.running):
            self.scheduler.sequence_done(seq)
            self.runner.forget(seq)
            self.kv_manager.release_sequence(seq, cache=False)
        req.running = []
        req.pending = []
        req.prompt_seq = None
        req.spec_state = None
        self.kv_manager.release_prompt(req)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        if req.deadline is not None:
            self._deadlines -= 1
        self.requests.pop(req.request_id, None)
        now = time.perf_counter()
        first = req.first_token_time if req.first_token_time is not None else now
        admitted = req.admit_time if req.admit_time is not None else first
        req.stats.queue_s = admitted - req.submit_time  # submitted -> first admitted
        req.stats.prefill_s = first - admitted  # admitted -> first token (prefill, and preemptions)
        req.stats.decode_s = now - first
        req.stats.cached_prompt_tokens = req.cached_tokens

    def _finish_request(self, req: RequestState, cancelled: bool = False, reason: str = "cancelled") -> None:
        self._release_request(req)
        if cancelled and req.beam is not None:  # a search cut short: what it has so far
            req.samples = req.beam.running_as_result(reason)
        elif cancelled:  # cut short (cancelled, or its time budget ran out): unfinished samples end so
            for st in req.samples:
                if not st.finished:
                    st.finish_reason = reason
        try:
            samples = [to_sample(st, self.decode) for st in req.samples]
        except Exception as exc:  # noqa: BLE001 - the final decode failed: the request fails
            req.error = exc
            emit(req, TokenEvent(req.request_id, done=True, error=exc))
            return
        out = SampleOutput(prompt_token_ids=list(req.prompt_ids), samples=samples, seed=req.seed, stats=req.stats)
        req.output = out
        emit(req, TokenEvent(req.request_id, done=True, output=out))

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
        self.kv_manager.check_integrity(self.holders())
        running = sum(len(r.running) for r in self.active)
        assert self.scheduler.num_running == running, f"num_running {self.scheduler.num_running} != {running}"

    def blocks_in_use(self) -> int:
        return self.pool.num_in_use


def working_set_bytes(config, cfg: EngineConfig) -> int:
    """Per-step buffers that grow with the batch: float32 logits of every decode row and the
    sampler's temporaries (softmax, filtered copies: ~4 rows of the vocabulary per row)."""
    rows = min(cfg.max_num_seqs + 1, cfg.max_batch_tokens + cfg.max_num_seqs)
    return rows * config.vocab_size * 4 * 5
