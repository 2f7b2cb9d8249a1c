"""The output processor: one batch of sampling arguments per step, the draw, stop rules, events.

It reads the step's logits, draws every sample's next token in one batched draw (rows grouped by
their sampling parameters, each row's randomness from (seed, sample, position): the same token
whatever the batch), applies the stop rules (`sampling/sample_state.py`), and emits one
`TokenEvent` per new token. A constrained request's samples get their grammar matchers here, at
their first draw (`sampling/constraints.py`, bound to the engine's tokenizer). It never touches blocks: it reports which prompts completed, which
sequences finished and which requests failed, and the engine hands those to the KV manager.

Failures are isolated per request: a stop check or final decode that raises (e.g. a tokenizer
that cannot decode an id) fails that request only; a failing batched draw fails the requests of
this step only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forklm.engine.model_runner import StepOutput
from forklm.engine.request import RequestState, Sequence, TokenEvent
from forklm.engine.scheduler import ScheduledBatch
from forklm.errors import InvalidArgumentError
from forklm.sampling.constraints import token_constraints
from forklm.sampling.sample_state import SampleState, check_finished, draw_rows, stop_token_set, to_sample
from forklm.tokenizer import Tokenizer


@dataclass
class StepResult:
    touched: list[RequestState] = field(default_factory=list)  # requests that got tokens (or failed) this step
    prompts_done: list[RequestState] = field(default_factory=list)  # prompts whose prefill completed
    finished_seqs: list[Sequence] = field(default_factory=list)  # samples that ended (blocks to release)
    failed: dict[int, tuple[RequestState, BaseException]] = field(default_factory=dict)  # id(req) -> (req, error)
    sample_ended: dict[int, RequestState] = field(default_factory=dict)  # requests a sample of which ended

    def fail(self, req: RequestState, exc: BaseException) -> None:
        self.failed.setdefault(id(req), (req, exc))


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int]], str], eos_token_ids: tuple[int, ...]) -> None:
        self.decode = decode
        self.eos_token_ids = eos_token_ids
        # the engine is handed its tokenizer's bound `decode`; constraints need that vocabulary
        tokenizer = getattr(decode, "__self__", None)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else None

    def process(self, batch: ScheduledBatch, out: StepOutput) -> StepResult:
        result = StepResult()
        row_of_seq = out.row_of_seq
        dec = batch.decode
        rows: list[int]  # logits row of each drawn state
        states: list[SampleState]
        seqs: list[Sequence | None]  # None: a sample's first token, from its prompt's logits
        owner: list[RequestState]  # the request of each drawn state
        if all(seq.sample is not None for seq in dec):  # decode rows of samples (the common case)
            rows = [row_of_seq[id(seq)] for seq in dec]
            states = [seq.sample for seq in dec]
            seqs = list(dec)
            owner = [seq.request for seq in dec]
            touched = {id(r): r for r in owner}
            rest = [c[0] for c in batch.chunks]
        else:
            rows, states, seqs, owner, touched = [], [], [], [], {}
            rest = dec + [c[0] for c in batch.chunks]
        for seq in rest:
            row = row_of_seq.get(id(seq))
            if row is None:
                continue
            req = seq.request
            touched[id(req)] = req
            if seq.sample is None:
                result.prompts_done.append(req)
                fresh = [st for st in req.samples if not st.token_ids]
                rows += [row] * len(fresh)
                states += fresh
                seqs += [None] * len(fresh)
                owner += [req] * len(fresh)
            else:
                rows.append(row)
                states.append(seq.sample)
                seqs.append(seq)
                owner.append(req)
        result.touched = list(touched.values())
        if not states:
            return result
        for r in result.touched:
            if r.stop_ids is None:
                r.stop_ids = stop_token_set(r.params, self.eos_token_ids)
            if r.params.constraint is not None and r.samples[0].matcher is None:
                try:
                    self._start_matchers(r)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others draw
                    result.fail(r, exc)
        if result.failed:
            keep = [i for i, r in enumerate(owner) if id(r) not in result.failed]
            rows, states, seqs, owner = ([x[i] for i in keep] for x in (rows, states, seqs, owner))
            if not states:
                return result
        try:
            if rows == list(range(out.logits.shape[0])):  # each row drawn once, in order: no copy
                picked = out.logits
            else:
                picked = out.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=out.logits.device))
            draw_rows(picked, states, [r.params for r in owner], [r.seed for r in owner], [r.stop_ids for r in owner])
        except Exception as exc:  # noqa: BLE001 - the whole draw failed: this step's requests fail
            for r in result.touched:
                result.fail(r, exc)
            return result
        self._count(result.touched, owner, out.shared_reads)
        failed = result.failed
        decode = self.decode
        for seq, st, r in zip(seqs, states, owner):
            if failed and id(r) in failed:
                continue
            try:
                fin = check_finished(st, r.params, r.stop_ids, decode)
                sample = to_sample(st, decode) if fin else None
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                result.fail(r, exc)
                continue
            if fin:
                result.sample_ended[id(r)] = r
                if seq is not None:
                    result.finished_seqs.append(seq)
            elif seq is not None:
                seq.tokens.append(st.token_ids[-1])
            if r.on_event is not None:
                emit(r, TokenEvent(r.request_id, st.index, st.token_ids[-1], st.logprobs[-1],
                                   st.finish_reason if fin else None,
                                   st.top_logprobs[-1] if st.top_logprobs else None, sample))
        return result

    def _start_matchers(self, req: RequestState) -> None:
        """Gives each sample of a constrained request its own matcher (at its first draw)."""
        if self.tokenizer is None:
            raise InvalidArgumentError(f"{req.params.constraint.param}: this engine has no tokenizer to constrain text with")
        constraints = token_constraints(self.tokenizer, self.eos_token_ids)
        for st, matcher in zip(req.samples, constraints.matchers(req.params.constraint, len(req.samples))):
            st.matcher = matcher

    @staticmethod
    def _count(touched: list[RequestState], owner: list[RequestState], shared_reads: int) -> None:
        """Per-request stats: generated tokens (`owner`: the request of each drawn token), decode
        steps and their wall times, paths taken."""
        now = time.perf_counter()
        path = "bifurcated" if shared_reads else "standard"
        for r in owner:
            r.stats.generated_tokens += 1
        for r in touched:
            if r.first_token_time is None:
                r.first_token_time = now
            if r.last_step_time is not None:  # a decode step (the first tokens come from the prefill's)
                stats = r.stats
                stats.steps += 1
                stats.path_steps[path] = stats.path_steps.get(path, 0) + 1
                stats.step_s.append(now - r.last_step_time)
            r.last_step_time = now


def emit(req: RequestState, event: TokenEvent) -> None:
    """Calls the request's callback; one that raises is dropped (the request still runs)."""
    if req.on_event is None:
        return
    try:
        req.on_event(event)
    except Exception:  # noqa: BLE001 - a consumer's failure must not break the engine
        req.on_event = None
