"""What speculative sampling runs with: one frozen dataclass, checked once, errors naming the key."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from forklm.errors import InvalidArgumentError

METHODS = ("ngram", "draft")
MAX_DRAFT_TOKENS = 32  # BASS's l_limit
# the command lines' --speculative (`SpeculativeConfig.from_text`)
SPECULATIVE_HELP = ("speculative sampling: ngram (drafts from the prompt and sibling samples), ngram:K (K draft tokens), "
                    "draft:MODEL[:K] (a draft model with this model's tokenizer), or a JSON object of the options; "
                    "samples are token for token those without it (default: off)")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (continuations of a sample's last tokens found in its prompt and its
    siblings' tokens; no weights).
    num_draft_tokens: "auto" (BASS Algorithm 1, capped by the measured cost rule) or a fixed k
    in [1, 32] (drafts of at most k tokens every step).
    cost_rule: with "auto", shorten drafts (down to none) where the measured step cost says
    verifying them costs more than they save (`draft_length.CostRule`).
    ngram_max / ngram_min: the longest and shortest suffix matched (ngram).
    method "draft": a smaller model with the target's tokenizer drafts (`draft_model.py`).
    draft_model: anything `LLM()` loads (a path, "smollm2-135m", "random:<shape>") or an already
    loaded `LLM` / `LlamaModel`; loaded with the target's device and dtype.
    draft_temperature: 0 (default): greedy drafts (point masses), verified by drawing the
    target's own token, so the output is token for token that of decoding without speculation;
    > 0: the draft samples from its distribution q (temperature, `draft_top_p`) and drafts are
    verified by modified rejection sampling: exact in distribution only, not token for token.
    """

    method: str = "ngram"
    num_draft_tokens: int | str = "auto"
    cost_rule: bool = True
    ngram_max: int = 4
    ngram_min: int = 1
    draft_model: Any = None
    draft_temperature: float = 0.0
    draft_top_p: float = 1.0

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
        if self.method == "draft" and self.draft_model is None:
            raise InvalidArgumentError("speculative method 'draft' needs a draft_model (a model path or name, or a loaded LLM)")
        if self.method != "draft" and self.draft_model is not None:
            raise InvalidArgumentError(f"speculative draft_model is for method 'draft', not {self.method!r}")
        t, p = self.draft_temperature, self.draft_top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 100:
            raise InvalidArgumentError(f"speculative draft_temperature must be a number in [0, 100], got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidArgumentError(f"speculative draft_top_p must be a number in (0, 1], got {p!r}")

    @property
    def fixed_length(self) -> int | None:
        return None if self.num_draft_tokens == "auto" else int(self.num_draft_tokens)

    @classmethod
    def from_text(cls, text: str | None) -> SpeculativeConfig | None:
        """A command line's `--speculative`: "none"/"off", a method name ("ngram"), "ngram:K"
        (K draft tokens), "draft:MODEL" / "draft:MODEL:K", or a JSON object of the fields."""
        if text is None or text.strip().lower() in ("", "none", "off"):
            return None
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidArgumentError(f"--speculative is not valid JSON: {exc}") from None
            if not isinstance(spec, dict):
                raise InvalidArgumentError("--speculative JSON must be an object of SpeculativeConfig fields")
            return cls.from_any(spec)
        method, _, rest = text.partition(":")
        if method == "draft":  # draft:MODEL[:K]; a path may hold ':' itself, so K is taken from the right
            model, _, k = rest.rpartition(":")
            if not k.isdigit() or not model:
                model, k = rest, ""
            if not model:
                raise InvalidArgumentError("--speculative draft needs a model: draft:MODEL or draft:MODEL:K")
            return cls(method="draft", draft_model=model, num_draft_tokens=int(k) if k else "auto")
        if rest:
            if not rest.isdigit():
                raise InvalidArgumentError(f"--speculative {text!r}: expected {method}:K with K a number of draft tokens")
            return cls(method=method, num_draft_tokens=int(rest))
        return cls(method=method)

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
