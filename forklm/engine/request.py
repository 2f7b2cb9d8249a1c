"""What the engine keeps per request and per running sequence (no tensors but the prompt logits)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forklm.cache.radix_cache import RadixNode
from forklm.sampling.sample_state import SampleState
from forklm.outputs import Stats
from forklm.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (or preempted entirely): holds no blocks
    PREFILLING = "prefilling"  # its prompt is being prefilled, chunk by chunk
    RUNNING = "running"  # prompt done: its samples decode (some may be pending: waves, preempted)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens whose KV lives in the paged cache under `block_table`.

    The prompt sequence of a request has `sample is None`; a sample's sequence holds the prompt
    plus the sample's tokens. `tokens[num_computed:]` still need a forward pass; the logits of
    the last one choose the next token.
    """

    request: RequestState
    tokens: list[int]
    block_table: list[int]
    num_computed: int
    sample: SampleState | None = None
    # speculative sampling, during one step: the draft appended to `tokens` to be verified, and
    # how many blocks the sequence held before slots were taken for it (what a rollback keeps)
    draft: list[int] = field(default_factory=list)
    blocks_before: int = 0
    # draft-model speculation: leading tokens whose draft-model KV is valid (-1: as many as
    # `num_computed` at creation), and q's rows [k, V] of a sampled draft during its step
    draft_computed: int = -1
    draft_probs: Any = None

    def __post_init__(self) -> None:
        if self.draft_computed < 0:
            self.draft_computed = self.num_computed

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(eq=False, slots=True)
class TokenEvent:
    """One new token of one sample, or the end of a request (`done`); what a stream receives."""

    request_id: str
    sample_index: int = -1
    token_id: int = -1
    logprob: float = 0.0
    finish_reason: str | None = None  # set on a sample's last token
    top_logprobs: list[tuple[int, float]] | None = None  # this token's alternatives, when asked for
    sample: Any = None  # the finished `Sample` (its final text), on a sample's last token
    done: bool = False  # the request finished: `output` holds the whole result
    output: Any = None  # SampleOutput, when done
    error: BaseException | None = None


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # submission order
    on_event: Callable[[TokenEvent], None] | None = None
    status: Status = Status.WAITING
    samples: list[SampleState] = field(default_factory=list)
    # while admitted (PREFILLING / RUNNING):
    prompt_seq: Sequence | None = None
    prompt_blocks: list[int] = field(default_factory=list)  # the request's references: all prompt blocks
    locked_node: RadixNode | None = None
    running: list[Sequence] = field(default_factory=list)
    pending: list[SampleState] = field(default_factory=list)  # unfinished samples without a sequence
    cancelled: bool = False
    waited_steps: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    stats: Stats = field(default_factory=Stats)
    submit_time: float = 0.0
    admit_time: float | None = None  # first admission
    first_token_time: float | None = None
    last_step_time: float | None = None  # the latest step that gave this request tokens
    output: Any = None  # SampleOutput, once finished
    error: BaseException | None = None  # why it failed, if it did (then `output` is None)
    stop_ids: set[int] | None = None  # token ids that end a sample (the output processor fills it)
    spec_state: Any = None  # the speculator's per-request drafter state (an n-gram index)
    deadline: float | None = None  # perf_counter time its time budget ends (params.time_budget_s)
    beam: Any = None  # its BeamSearch (sampling/beam.py) when params.beam_width > 0: `samples` are then the live beams

    @property
    def num_sequences(self) -> int:
        """Sequences it runs side by side: its n samples, or its beam_width beams."""
        return self.params.beam_width or self.params.n

    @property
    def unfinished_samples(self) -> list[SampleState]:
        return [s for s in self.samples if not s.finished]
