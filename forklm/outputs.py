"""What a request returns: its samples, ranking by mean log-probability, and timing stats."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Sample:
    index: int  # i in 0..n-1; its random draws depend only on (seed, i, step)
    text: str
    token_ids: list[int]
    logprobs: list[float]  # the model's log-softmax of each chosen token (before temperature etc.)
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length", "time" (time budget), "cancelled"
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    # per token, the `top_logprobs` most likely (token id, model log-prob), when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # beam search: the hypothesis's score, sum(logprobs) / len(token_ids) ** length_penalty (best first)
    score: float | None = None

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def mean_logprob(self) -> float:
        return self.cumulative_logprob / len(self.logprobs) if self.logprobs else float("-inf")


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    generated_tokens: int = 0
    queue_s: float = 0.0  # submitted -> admitted (waiting for memory or its turn)
    prefill_s: float = 0.0  # admitted -> first token (the prompt's prefill)
    decode_s: float = 0.0  # first token -> last token
    steps: int = 0  # engine steps that gave this request tokens
    path_steps: dict[str, int] = field(default_factory=dict)  # steps taken by each attention path
    step_s: list[float] = field(default_factory=list, repr=False)  # wall time of each decode step

    @property
    def ttft_s(self) -> float:
        """Time to first token: queueing + prefill."""
        return self.queue_s + self.prefill_s

    @property
    def median_step_s(self) -> float:
        """Median decode step (sample + stop checks + one forward over the live samples)."""
        return statistics.median(self.step_s) if self.step_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decoding."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        paths = ", ".join(f"{k} {v}" for k, v in sorted(self.path_steps.items())) or "-"
        return (
            f"prompt {self.prompt_tokens} tok ({self.cached_prompt_tokens} cached) | queue {self.queue_s:.3f} s | "
            f"prefill {self.prefill_s:.3f} s | "
            f"decode {self.decode_s:.3f} s, {self.steps} steps ({paths}) | "
            f"{self.generated_tokens} tok generated, {self.tokens_per_s:.1f} tok/s"
        )


@dataclass
class SampleOutput:
    prompt_token_ids: list[int]
    samples: list[Sample]
    seed: int
    stats: Stats

    def ranked(self, k: int | None = None) -> list[Sample]:
        """Samples de-duplicated by text, best mean log-probability first (at most k)."""
        best: dict[str, Sample] = {}
        for s in self.samples:
            if s.text not in best or s.mean_logprob > best[s.text].mean_logprob:
                best[s.text] = s
        order = sorted(best.values(), key=lambda s: (-s.mean_logprob, s.index))
        return order if k is None else order[:k]
