"""What speculative sampling runs with: one frozen dataclass, checked once, errors naming the key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from forklm.errors import InvalidArgumentError

METHODS = ("ngram",)
MAX_DRAFT_TOKENS = 32  # BASS's l_limit


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (continuations of a sample's last tokens found in its prompt and its
    siblings' tokens; no weights).
    num_draft_tokens: "auto" (BASS Algorithm 1, capped by the measured cost rule) or a fixed k
    in [1, 32] (drafts of at most k tokens every step).
    cost_rule: with "auto", shorten drafts (down to none) where the measured step cost says
    verifying them costs more than they save (`draft_length.CostRule`).
    ngram_max / ngram_min: the longest and shortest suffix matched (ngram).
    """

    method: str = "ngram"
    num_draft_tokens: int | str = "auto"
    cost_rule: bool = True
    ngram_max: int = 4
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgumentError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_draft_tokens
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise InvalidArgumentError(
                f"speculative num_draft_tokens must be 'auto' or an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        if not isinstance(self.cost_rule, bool):
            raise InvalidArgumentError(f"speculative cost_rule must be True or False, got {self.cost_rule!r}")
        for name in ("ngram_max", "ngram_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 16:
                raise InvalidArgumentError(f"speculative {name} must be an integer in [1, 16], got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise InvalidArgumentError(f"speculative ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")

    @property
    def fixed_length(self) -> int | None:
        return None if self.num_draft_tokens == "auto" else int(self.num_draft_tokens)

    @classmethod
    def from_any(cls, spec: Any) -> SpeculativeConfig | None:
        """None / False: off; a SpeculativeConfig; a method name ("ngram"); or a dict of its fields."""
        if spec is None or spec is False:
            return None
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            return cls(method=spec)
        if isinstance(spec, dict):
            allowed = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(spec) - set(allowed))
            if unknown:
                raise InvalidArgumentError(f"speculative has unknown keys {unknown}; allowed: {allowed}")
            return cls(**spec)
        raise InvalidArgumentError(
            f"speculative must be None, a method name, a dict or a SpeculativeConfig, got {type(spec).__name__}")
