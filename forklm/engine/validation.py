"""Request validation in one place: what makes a request unable to run on an engine.

`LLM`, `EngineLoop` and the server call `Engine.validate_request` (which calls this) and map
its `InvalidArgumentError` to their own error shapes; none of them repeats these checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from forklm.errors import InvalidArgumentError
from forklm.sampling.params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_positions: int  # the model's context length
    has_tokenizer: bool  # stop strings and constraints need text
    num_blocks: int  # KV pool size
    block_size: int
    max_num_seqs: int = 256  # running sequences at most (a beam search runs all its beams at once)


def min_blocks(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Blocks one request needs to make progress with a single sample."""
    bs = block_size
    return -(-prompt_len // bs) + -(-(prompt_len % bs + max_tokens) // bs)


def validate_request(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> None:
    """Raises InvalidArgumentError (naming the parameter) unless the request can run."""
    V = limits.vocab_size
    if not prompt_ids:
        raise InvalidArgumentError("prompt must not be empty")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V for t in prompt_ids):
        raise InvalidArgumentError(f"prompt token ids must be integers in [0, {V})")
    if any(not 0 <= t < V for t in params.stop_token_ids):
        raise InvalidArgumentError(f"stop_token_ids must be token ids in [0, {V})")
    if params.stop and not limits.has_tokenizer:
        raise InvalidArgumentError("stop: this model has no tokenizer, so stop strings cannot match; use stop_token_ids")
    if params.constraint is not None and not limits.has_tokenizer:
        raise InvalidArgumentError(f"{params.constraint.param}: this model has no tokenizer (random weights), so its "
                                   "text cannot be constrained")
    if len(prompt_ids) + params.max_tokens > limits.max_positions:
        raise InvalidArgumentError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context length of {limits.max_positions} tokens"
        )
    need = min_blocks(len(prompt_ids), params.max_tokens, limits.block_size)
    if params.beam_width:
        k = params.beam_width
        if k > limits.max_num_seqs:
            raise InvalidArgumentError(f"beam_width ({k}) exceeds the engine's max_num_seqs ({limits.max_num_seqs}): "
                                       "a beam step needs every beam's row")
        if 4 * k > V:
            raise InvalidArgumentError(f"beam_width ({k}) is too large for a vocabulary of {V} tokens")
        bs = limits.block_size
        need = -(-len(prompt_ids) // bs) + k * -(-(len(prompt_ids) % bs + params.max_tokens) // bs)
        if need > limits.num_blocks:
            raise InvalidArgumentError(
                f"beam search needs up to {need} KV blocks (prompt {len(prompt_ids)}, beam_width {k} x max_tokens "
                f"{params.max_tokens}, block size {bs}) but the engine's pool holds {limits.num_blocks}; shorten it "
                "or give the engine more memory")
    if need > limits.num_blocks:
        raise InvalidArgumentError(
            f"request needs at least {need} KV blocks (prompt {len(prompt_ids)} + max_tokens "
            f"{params.max_tokens}, block size {limits.block_size}) but the engine's pool holds "
            f"{limits.num_blocks}; it can never run: shorten it or give the engine more memory"
        )
