"""Sampling parameters of a request, validated once, with errors that name the argument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from forklm.errors import InvalidArgumentError
from forklm.sampling.constraints import Constraint
from forklm.sampling.sampler import GREEDY_BELOW

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 64
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy (so is anything below sampler.GREEDY_BELOW = 1e-5)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives recorded per token (the most likely, by the model's log-softmax)
    attention: str = "auto"  # "auto" | "bifurcated" | "standard"
    constraint: Constraint | None = None  # what every sample's text must match (`constraints.make_constraint`)
    jump_forward: bool = True  # a constrained sample appends the runs its grammar forces in one step each
    speculative: bool = True  # may speculate where the engine does (False: this request decodes one token per step)
    # seconds from submission after which unfinished samples end with finish_reason "time" (None: no limit)
    time_budget_s: float | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{name} must be {allowed}, got {value!r}")

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "an integer in [0, 2**63) or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.attention not in ("auto", "bifurcated", "standard"):
            raise bad("attention", self.attention, "one of 'auto', 'bifurcated', 'standard'")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise bad("constraint", self.constraint, "a Constraint (forklm.sampling.constraints.make_constraint) or None")
        if not isinstance(self.jump_forward, bool):
            raise bad("jump_forward", self.jump_forward, "True or False")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", self.speculative, "True or False")
        if self.time_budget_s is not None and (not _is_number(self.time_budget_s)
                                               or not 0 < self.time_budget_s < math.inf):
            raise bad("time_budget_s", self.time_budget_s, "a positive number of seconds or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
