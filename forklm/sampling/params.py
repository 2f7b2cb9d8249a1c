"""Sampling parameters of a request, validated once, with errors that name the argument."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from forklm.errors import InvalidArgumentError
from forklm.sampling.constraints import Constraint, make_constraint
from forklm.sampling.sampler import GREEDY_BELOW

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """A request's sampling surface, declared once: `LLM.sample`'s keywords, `Request`'s fields, the
    CLI's and the server's mapping all derive from these fields. Validated on construction, each
    error naming its argument."""

    n: int = 1
    max_tokens: int = 64
    min_tokens: int = 0  # tokens per sample before EOS / a stop may end it
    temperature: float = 1.0  # 0 = greedy (so is anything below sampler.GREEDY_BELOW = 1e-5)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: str | tuple[str, ...] = ()  # a string or a list of strings (held as a tuple)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives recorded per token (the most likely, by the model's log-softmax), 0..20
    # at most one constraint, which every sample's text then matches (see sampling/constraints.py):
    # (compared and hashed through the compiled `SamplingParams.constraint`, not as given)
    json_schema: dict | str | None = field(default=None, compare=False)  # a JSON schema (dict or its JSON text)
    regex: str | None = field(default=None, compare=False)  # a regular expression the whole text matches
    grammar: str | None = field(default=None, compare=False)  # a Lark grammar (llguidance's dialect; GBNF too)
    choice: Sequence[str] | None = field(default=None, compare=False)  # the text is one of these strings
    jump_forward: bool = True  # a constrained sample appends each run its grammar forces in one step
    speculative: bool = True  # may speculate where the engine does (False: one token per step)
    time_budget_s: float | None = None  # seconds from submission; then unfinished samples end with "time"
    # beam search (sampling/beam.py; transformers' generate(num_beams=...) semantics): beam_width k >= 1
    # turns it on (0: sampling); n of the k hypotheses are returned, best score first
    beam_width: int = 0
    length_penalty: float = 1.0  # a hypothesis scores sum(log-probs) / generated_len ** length_penalty
    early_stopping: bool | str = False  # True: end at k finished; False: a heuristic; "never": only when no beam can improve
    num_beam_groups: int = 1  # diverse beam search: the k beams in this many groups of k / groups
    diversity_penalty: float = 0.0  # subtracted per earlier group's beam choosing the same token at a step

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{name} must be {allowed}, got {value!r}")

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            if stop is not None:
                raise bad("stop", stop, "a string or a list of non-empty strings")
            stop = ()
        object.__setattr__(self, "stop", tuple(stop))
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.choice is not None and isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
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
        if not isinstance(self.jump_forward, bool):
            raise bad("jump_forward", self.jump_forward, "True or False")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", self.speculative, "True or False")
        if self.time_budget_s is not None and (not _is_number(self.time_budget_s)
                                               or not 0 < self.time_budget_s < math.inf):
            raise bad("time_budget_s", self.time_budget_s, "a positive number of seconds or None")
        self._check_beam_options(bad)

    def _check_beam_options(self, bad) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 0:
            raise bad("beam_width", self.beam_width, "an integer >= 0 (0 = sampling, no beam search)")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise bad("length_penalty", self.length_penalty, "a finite number")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise bad("early_stopping", self.early_stopping, 'True, False or "never"')
        if not _is_int(self.num_beam_groups) or self.num_beam_groups < 1:
            raise bad("num_beam_groups", self.num_beam_groups, "an integer >= 1")
        if not _is_number(self.diversity_penalty) or not 0 <= self.diversity_penalty < math.inf:
            raise bad("diversity_penalty", self.diversity_penalty, "a number >= 0")
        if not self.beam_width:
            for name, default in BEAM_DEFAULTS.items():
                value = getattr(self, name)
                if value != default:
                    raise InvalidArgumentError(f"{name} applies to beam search only: set beam_width >= 1 (got "
                                               f"{name}={value!r} with beam_width=0)")
            return
        k = self.beam_width
        if self.n > k:
            raise bad("n", self.n, f"<= beam_width ({k}): beam search returns at most beam_width hypotheses")
        if self.temperature != 1.0 or self.top_p != 1.0 or self.top_k != 0:
            raise InvalidArgumentError(
                "beam search is deterministic (transformers' do_sample=False): temperature, top_p and top_k do not "
                f"apply to it; leave them at their defaults (got temperature={self.temperature!r}, "
                f"top_p={self.top_p!r}, top_k={self.top_k!r})")
        for name in ("json_schema", "regex", "grammar", "choice"):
            if getattr(self, name) is not None:
                raise InvalidArgumentError(f"{name}: constrained beam search is not supported; use sampling (n) with "
                                           "the constraint, or beam search without it")
        if self.top_logprobs:
            raise bad("top_logprobs", self.top_logprobs, "0 with beam search (not supported)")
        if self.time_budget_s is not None:
            raise bad("time_budget_s", self.time_budget_s, "None with beam search (a cut search has no ranked "
                      "hypotheses; not supported)")
        if k % self.num_beam_groups:
            raise bad("num_beam_groups", self.num_beam_groups, f"a divisor of beam_width ({k})")
        if self.diversity_penalty and self.num_beam_groups == 1:
            raise bad("diversity_penalty", self.diversity_penalty, "0 unless num_beam_groups > 1 (it acts "
                      "between groups)")
        object.__setattr__(self, "speculative", False)  # beams take one token per step (no drafts to verify)

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 0

    def params(self, **engine: object) -> SamplingParams:
        """These options as the engine's `SamplingParams` (`engine`: its further fields, e.g. attention)."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(SamplingOptions)}, **engine)


OPTION_NAMES = tuple(f.name for f in fields(SamplingOptions))
BEAM_DEFAULTS = {"length_penalty": 1.0, "early_stopping": False, "num_beam_groups": 1, "diversity_penalty": 0.0}


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingOptions):
    """The options as the engine runs them: the constraint compiled (from json_schema / regex / grammar /
    choice, or given ready-made by the server, whose parameter names it carries), the attention path."""

    attention: str = "auto"  # "auto" | "bifurcated" | "standard"
    constraint: Constraint | None = None  # what every sample's text must match (`constraints.make_constraint`)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention not in ("auto", "bifurcated", "standard"):
            raise InvalidArgumentError(f"attention must be one of 'auto', 'bifurcated', 'standard', got {self.attention!r}")
        given = any(x is not None for x in (self.json_schema, self.regex, self.grammar, self.choice))
        if self.constraint is not None:  # (compiled already: by the server, or before a dataclasses.replace)
            if not isinstance(self.constraint, Constraint):
                raise InvalidArgumentError(f"constraint must be a Constraint (forklm.sampling.constraints."
                                           f"make_constraint) or None, got {self.constraint!r}")
        elif given:
            object.__setattr__(self, "constraint", make_constraint(
                json_schema=self.json_schema, regex=self.regex, grammar=self.grammar, choice=self.choice))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
