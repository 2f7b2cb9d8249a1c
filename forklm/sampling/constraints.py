"""Constrained decoding: every sample's text follows a JSON schema, a regex, a grammar or a choice.

    Constraint (what the user asked, checked once)  --compile, cached by its text-->  llguidance grammar
    TokenConstraints (one per tokenizer)            --per request, cached-->         a start matcher
    SampleMatcher (one per sample, a copy of it)    --per step-->                    a token mask, then the drawn token

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance): its tokenizer is
bound from the model's Hugging Face `tokenizers` tokenizer (its JSON), so it sees exactly the
model's vocabulary. Each step, `masked_logits` sets the logits of every token the grammar
does not allow next to -inf in the constrained rows, before temperature/top-k/top-p; end-of-
sequence is allowed only where the grammar accepts. After the draw, the sample's matcher consumes
the token (`check_finished`); once the grammar can take nothing more, the sample stops ("stop").

JSON schemas are compiled with fixed separators (", " and ": ", as Python's json.dumps writes)
and no other whitespace: a small model at temperature 1 otherwise spends its tokens on blank
lines. A schema may override this with llguidance's "x-guidance" options.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from forklm.errors import InvalidArgumentError, UnsupportedModelError

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's text at most (1 MiB): compiling is the user's cost
# llguidance builds a grammar recursively along its chains of rules / $refs / groups: a few thousand
# (tens of kB of text) overflow a thread's usual 8 MiB stack and kill the process. It builds on a
# thread of its own whose stack grows with the text (at most ~1.4 kB a character was measured).
COMPILE_STACK_BYTES_PER_CHAR = 2 << 10
MIN_COMPILE_STACK_BYTES = 64 << 20
COMPILED_CACHE_SIZE = 64  # start matchers kept per tokenizer, by constraint text


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its kind (the parameter that set it) and its text (the schema as
    JSON, the regex, the grammar, or the choices as a JSON list). Equal texts share a compilation."""

    kind: str
    text: str

    @property
    def param(self) -> str:
        """The parameter an error about this constraint names."""
        return "json_schema" if self.kind == "json_object" else self.kind

    def describe(self) -> str:
        return self.kind if self.kind == "json_object" else f"{self.kind}={self.text[:60]!r}"


def make_constraint(
    *,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    json_object: bool = False,
) -> Constraint | None:
    """The constraint these arguments ask for (None: unconstrained), compiled once to check it.
    Raises InvalidArgumentError naming the parameter: more than one given, a wrong type, a schema
    or regex or grammar llguidance cannot compile."""
    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                            ("choice", choice), ("json_object", json_object or None)) if v is not None]
    if len(given) > 1:
        raise InvalidArgumentError(f"{given[1]}: only one constraint per request; got {' and '.join(given)}")
    if not given:
        return None
    kind = given[0]
    if kind == "json_object":
        if json_object is not True:
            raise InvalidArgumentError(f"json_object must be True or False, got {json_object!r}")
        constraint = Constraint("json_object", '{"type": "object"}')
    elif kind == "json_schema":
        constraint = Constraint("json_schema", _schema_text(json_schema))
    elif kind == "choice":
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice \
                or not all(isinstance(c, str) and c for c in choice):
            raise InvalidArgumentError(f"choice must be a non-empty list of non-empty strings, got {_quote(choice)}")
        constraint = Constraint("choice", json.dumps(list(choice), ensure_ascii=False))
    else:
        value = regex if kind == "regex" else grammar
        if not isinstance(value, str) or not value:
            raise InvalidArgumentError(f"{kind} must be a non-empty string, got {_quote(value)}")
        constraint = Constraint(kind, value)
    if len(constraint.text) > MAX_CONSTRAINT_CHARS:
        raise InvalidArgumentError(f"{constraint.param} is {len(constraint.text)} characters long; "
                                   f"at most {MAX_CONSTRAINT_CHARS} are allowed")
    compiled_grammar(constraint)  # raises InvalidArgumentError naming the parameter
    return constraint


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"json_schema is not valid JSON ({e})") from None
        except RecursionError:
            raise InvalidArgumentError("json_schema is nested too deeply") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidArgumentError(f"json_schema must be a JSON schema (a dict or its JSON text), got {_quote(schema)}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"json_schema must hold only JSON values ({e})") from None
    except RecursionError:
        raise InvalidArgumentError("json_schema is nested too deeply") from None


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _on_large_stack(chars: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a new thread with a stack for building a grammar of `chars` characters."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outcome.append((False, e))

    size = max(MIN_COMPILE_STACK_BYTES, chars * COMPILE_STACK_BYTES_PER_CHAR)
    with _STACK_SIZE_LOCK:  # the size is process-wide: set for this thread's start only
        previous = threading.stack_size(size)
        try:
            thread = threading.Thread(target=run, name="forklm-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return value


_STACK_SIZE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=256)
def compiled_grammar(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (cached by its text); InvalidArgumentError naming the
    parameter if llguidance cannot compile it."""
    return _on_large_stack(len(constraint.text), _compile, constraint)


def _compile(constraint: Constraint) -> str:
    try:
        if constraint.kind in ("json_schema", "json_object"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_DEFAULTS)
        elif constraint.kind == "regex":
            grammar = llguidance.grammar_from("regex", constraint.text)
        elif constraint.kind == "grammar":  # Lark (llguidance's dialect) or GBNF
            grammar = llguidance.grammar_from("grammar", constraint.text)
        else:
            grammar = llguidance.grammar_from("choice", json.loads(constraint.text))
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{constraint.param} cannot be compiled: {_one_line(str(e))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgumentError(f"{constraint.param} cannot be compiled: {_one_line(error)}")
    return grammar


def _first_line(message: str, limit: int = 200) -> str:
    """An llguidance error's first line (the rest dumps its parser state)."""
    line = (message.strip().splitlines() or ["(no message)"])[0]
    return line if len(line) <= limit else line[:limit] + "..."


_CARETS = re.compile(r"\^[\^ ]*")  # the marks under a quoted source line
_SOURCE_LINE = re.compile(r"\d+ \| ")  # llguidance's numbered grammar lines


def _one_line(message: str, limit: int = 300) -> str:
    """An llguidance error as one line: its lines less the source quoted and marked with ^^^
    (a regex parse error's reason is on a line of its own after them), each cut to 120 characters."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [line if len(line) <= 120 else line[:120] + "..." for i, line in enumerate(lines)
            if line and not _CARETS.fullmatch(line) and not _SOURCE_LINE.match(line)
            and not (i + 1 < len(lines) and _CARETS.fullmatch(lines[i + 1]))]
    text = " ".join(kept) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."


# grammar steps a new constraint is walked at check time (`TokenConstraints._probe`)
PROBE_STEPS = 4


class ConstraintError(RuntimeError):
    """A sample's matcher refused a token or failed (a bug or a resource limit, not bad input)."""


class SampleMatcher:
    """One sample's position in its grammar (llguidance's LLMatcher); survives preemption, as it
    lives with the sample's tokens, not with its KV."""

    __slots__ = ("_matcher", "_prepared", "constraint", "consumed", "vocab_size")

    def __init__(self, matcher: Any, constraint: Constraint, vocab_size: int) -> None:
        self._matcher = matcher
        self.constraint = constraint
        self.vocab_size = vocab_size  # the tokenizer's: a mask row has (vocab_size + 31) // 32 words
        self.consumed = 0  # tokens consumed so far (a prepared mask is valid only at its count)
        self._prepared: tuple[int, torch.Tensor] | None = None  # (consumed, mask row) from `prepare_mask`

    def consume(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ConstraintError(f"{self.constraint.describe()}: the grammar refused token {token_id}: "
                                  f"{_one_line(self._matcher.get_error())}")
        self.consumed += 1

    def take_forced(self, limit: int) -> list[int]:
        """Jump-forward: the tokens the grammar forces from here (llguidance's fast-forward tokens:
        the forced text in the tokenizer's canonical split, less any tail that could merge with
        the text after it), at most `limit` of them, consumed. Empty when the next token is free."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        forced = self._matcher.compute_ff_tokens()[:limit]
        if forced and not self._matcher.consume_tokens(forced):
            raise ConstraintError(f"{self.constraint.describe()}: the grammar refused its own forced tokens "
                                  f"{forced}: {_one_line(self._matcher.get_error())}")
        self.consumed += len(forced)
        return forced

    @property
    def finished(self) -> bool:
        """Whether the grammar takes no more text (only end-of-sequence)."""
        return self._matcher.is_stopped()

    def prepare_mask(self, words: int) -> None:
        """Computes the next mask now (on a worker thread while the model runs: llguidance releases
        the GIL); `fill_mask` then copies it, if nothing was consumed since."""
        row = torch.empty(words, dtype=torch.int32)
        self._compute(row)
        self._prepared = (self.consumed, row)

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        """Writes the allowed next tokens as bits into an int32 row (llguidance's layout). A matcher
        that failed (a grammar past llguidance's limits) allows everything here, so that the batch
        draws on, and `consume` then fails its request alone."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == self.consumed and prepared[1].numel() == bitmask_row.numel():
            bitmask_row.copy_(prepared[1])
            return
        self._compute(bitmask_row)

    def _compute(self, bitmask_row: torch.Tensor) -> None:
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), bitmask_row.numel() * 4)
        if self._matcher.is_error():
            bitmask_row.fill_(-1)


class MaskWorker:
    """Computes the masks of the rows that will draw this step on one worker thread while the
    model's forward runs (`start` before the forward, `wait` before the draw). Keeps the time
    the masks took (`compute_s`) and the time the step waited for them (`wait_s`)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self.compute_s = 0.0
        self.wait_s = 0.0
        self.masks = 0

    def start(self, matchers: list[SampleMatcher]) -> None:
        self.wait()
        if not matchers:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="forklm-masks")
        self._future = self._pool.submit(self._run, matchers)

    def _run(self, matchers: list[SampleMatcher]) -> None:
        t0 = time.perf_counter()
        words = (matchers[0].vocab_size + 31) // 32
        for m in matchers:
            m.prepare_mask(words)
        self.compute_s += time.perf_counter() - t0
        self.masks += len(matchers)

    def wait(self) -> None:
        """Blocks until the masks started are done (a failure there is ignored: `fill_mask`
        computes what is missing, and reports the error)."""
        future, self._future = self._future, None
        if future is None:
            return
        t0 = time.perf_counter()
        try:
            future.result()
        except Exception:  # noqa: BLE001, S110 - recomputed (and raised) at the draw
            pass
        self.wait_s += time.perf_counter() - t0


class TokenConstraints:
    """Constraints bound to one tokenizer: llguidance's view of its vocabulary and a small LRU of
    start matchers by constraint text; `matchers` hands each sample its own copy."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = tokenizer.vocab_size
        # the tokenizer's own JSON (vocabulary, merges, special tokens; forklm's Tokenizer has no
        # public accessor to its backend yet): llguidance reads it with the same Rust `tokenizers`
        # library; every end-of-sequence id the engine stops on is one
        try:
            self.lltokenizer = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                                                      eos_token=list(eos_token_ids))
        except Exception as e:  # noqa: BLE001 - llguidance's own error types
            raise UnsupportedModelError(f"constraints: llguidance cannot read this model's tokenizer ({e})") from None
        self._starts: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _probe(self, constraint: Constraint, matcher: Any, steps: int = PROBE_STEPS) -> None:
        """The first masks, on a copy, along the lowest allowed token: some grammars compile and fail
        only when a mask is computed or a token consumed (a schema that refers to itself without
        end, a regex whose bounded repetition is past llguidance's lexer limits); found here, they
        are the caller's bad input instead of a failure at the request's first steps."""
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        for step in range(steps):
            if matcher.is_stopped():
                return
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if matcher.is_error():
                raise InvalidArgumentError(f"{constraint.param} cannot be used: {_first_line(matcher.get_error())}")
            allowed = np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: self.vocab_size])
            if allowed.size == 0:
                if step == 0:
                    raise InvalidArgumentError(f"{constraint.param} allows no text at all: no token can start it")
                return
            if not matcher.consume_token(int(allowed[0])) or matcher.is_error():
                raise InvalidArgumentError(f"{constraint.param} cannot be used: {_first_line(matcher.get_error())}")

    def check(self, constraint: Constraint) -> None:
        """Raises InvalidArgumentError naming the parameter unless the constraint runs with this
        tokenizer (its matcher built and its first mask computed, then kept for the request)."""
        self._start(constraint)

    def matchers(self, constraint: Constraint, count: int) -> list[SampleMatcher]:
        """`count` fresh matchers of a constraint (compiled once, then copied)."""
        start = self._start(constraint)
        return [SampleMatcher(start.deep_copy(), constraint, self.vocab_size) for _ in range(count)]

    def _start(self, constraint: Constraint) -> Any:
        with self._lock:
            start = self._starts.get(constraint)
            if start is not None:
                self._starts.move_to_end(constraint)
                return start
        grammar = compiled_grammar(constraint)
        start = _on_large_stack(len(grammar), llguidance.LLMatcher, self.lltokenizer, grammar, log_level=0)
        if start.is_error():
            raise InvalidArgumentError(f"{constraint.param} cannot be compiled: {_one_line(start.get_error())}")
        self._probe(constraint, start.deep_copy())
        with self._lock:
            self._starts[constraint] = start
            while len(self._starts) > COMPILED_CACHE_SIZE:
                self._starts.popitem(last=False)
        return start


@functools.lru_cache(maxsize=8)
def token_constraints(tokenizer: Any, eos_token_ids: tuple[int, ...]) -> TokenConstraints:
    """The binding of a tokenizer (built once: ~0.2 s for a 49k vocabulary)."""
    return TokenConstraints(tokenizer, eos_token_ids)


def masked_logits(logits: torch.Tensor, rows: list[int], matchers: Sequence[SampleMatcher]) -> torch.Tensor:
    """A copy of the logits in which each of `rows` (matchers[i] for rows[i]) keeps only the
    tokens its grammar allows next, the others at -inf (also the columns past the tokenizer's
    vocabulary); other rows are copied unchanged. One pass over the logits."""
    V = logits.shape[1]
    words = (matchers[0].vocab_size + 31) // 32
    bits = torch.zeros(len(rows), max(words, (V + 31) // 32), dtype=torch.int32)  # 0: not allowed
    for i, m in enumerate(matchers):
        m.fill_mask(bits[i, :words])
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, count=V, bitorder="little")
    allowed = torch.from_numpy(allowed).view(torch.bool).to(logits.device, non_blocking=True)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if rows == list(range(logits.shape[0])):
        return torch.where(allowed, logits, minus_inf)
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[idx] = torch.where(allowed, logits.index_select(0, idx), minus_inf)
    return out
