"""The output processor: one batch of sampling arguments per step, the draw, stop rules, events.

It reads the step's logits, draws every sample's next token in one batched draw (rows grouped by
their sampling parameters, each row's randomness from (seed, sample, position): the same token
whatever the batch), applies the stop rules (`sampling/sample_state.py`), and emits one
`TokenEvent` per new token. It never touches blocks: it reports which prompts completed, which
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
from forklm.sampling.sample_state import SampleState, check_finished, draw_rows, stop_token_set, to_sample


@dataclass
class StepResult:
    touched: list[RequestState] = field(default_factory=list)  # requests that got tokens (or failed) this step
    prompts_done: list[RequestState] = field(default_factory=list)  # prompts whose prefill completed
    finished_seqs: list[Sequence] = field(default_factory=list)  # samples that ended (blocks to release)
    failed: dict[int, tuple[RequestState, BaseException]] = field(default_factory=dict)  # id(req) -> (req, error)

    def fail(self, req: RequestState, exc: BaseException) -> None:
        self.failed.setdefault(id(req), (req, exc))


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int]], str], eos_token_ids: tuple[int, ...]) -> None:
        self.decode = decode
        self.eos_token_ids = eos_token_ids

    def process(self, batch: ScheduledBatch, out: StepOutput) -> StepResult:
        result = StepResult()
        rows: list[int] = []  # logits row of each drawn state
        states: list[SampleState] = []
        seqs: list[Sequence | None] = []  # None: a sample's first token, from its prompt's logits
        owner: list[RequestState] = []  # the request of each drawn state
        touched: dict[int, RequestState] = {}
        for seq in batch.decode + [c[0] for c in batch.chunks]:
            if id(seq) not in out.row_of_seq:
                continue
            req = seq.request
            touched[id(req)] = req
            row = out.row_of_seq[id(seq)]
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
        stop_sets = {id(r): stop_token_set(r.params, self.eos_token_ids) for r in result.touched}
        try:
            if rows == list(range(out.logits.shape[0])):  # each row drawn once, in order: no copy
                picked = out.logits
            else:
                picked = out.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=out.logits.device))
            draw_rows(
                picked,
                states,
                [r.params for r in owner],
                [r.seed for r in owner],
                [stop_sets[id(r)] for r in owner],
            )
        except Exception as exc:  # noqa: BLE001 - the whole draw failed: this step's requests fail
            for r in result.touched:
                result.fail(r, exc)
            return result
        done: list[bool] = []
        for st, r in zip(states, owner):
            if id(r) in result.failed:
                done.append(True)
                continue
            try:
                done.append(check_finished(st, r.params, stop_sets[id(r)], self.decode))
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                result.fail(r, exc)
                done.append(True)
        self._count(owner, out.shared_reads)
        for seq, st, r, fin in zip(seqs, states, owner, done):
            if id(r) in result.failed:
                continue
            if seq is not None and not fin:
                seq.tokens.append(st.token_ids[-1])
            try:
                sample = to_sample(st, self.decode) if fin else None
            except Exception as exc:  # noqa: BLE001
                result.fail(r, exc)
                continue
            emit(r, TokenEvent(
                r.request_id, st.index, st.token_ids[-1], st.logprobs[-1], st.finish_reason if fin else None,
                top_logprobs=st.top_logprobs[-1] if st.top_logprobs else None, sample=sample,
            ))
            if seq is not None and fin:
                result.finished_seqs.append(seq)
        return result

    @staticmethod
    def _count(owner: list[RequestState], shared_reads: int) -> None:
        """Per-request stats: generated tokens, decode steps and their wall times, paths taken."""
        now = time.perf_counter()
        path = "bifurcated" if shared_reads else "standard"
        counted: set[int] = set()
        for r in owner:
            if r.first_token_time is None:
                r.first_token_time = now
            r.stats.generated_tokens += 1
            if id(r) in counted:
                continue
            counted.add(id(r))
            if r.last_step_time is not None:  # a decode step (the first tokens come from the prefill's)
                r.stats.steps += 1
                r.stats.path_steps[path] = r.stats.path_steps.get(path, 0) + 1
                r.stats.step_s.append(now - r.last_step_time)
            r.last_step_time = now


def emit(req: RequestState, event: TokenEvent) -> None:
    """Calls the request's callback; one that raises is dropped (the request still runs)."""
    if req.on_event is None:
        return
    try:
        req.on_event(event)
    except Exception:  # noqa: BLE001 - a consumer's failure must not break the engine
        req.on_event = None
