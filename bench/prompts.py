"""The sweep's sampling settings and its synthetic prompt (a code snippet's token ids, repeated), shared
by the sweep (sweep.py) and the presets' probe (presets.py)."""

from __future__ import annotations

from typing import Any

TEMPERATURE = 0.8
TOP_P = 0.95
SEED = 0

# The synthetic prompt: this snippet's token ids, repeated and cut to m_c tokens.
SNIPPET = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        if key not in self.data:
            return None
        value = self.data.pop(key)
        self.data[key] = value
        return value
'''


def synthetic_prompt(tokenizer: Any, vocab_size: int, m_c: int) -> list[int]:
    """Exactly m_c deterministic token ids: BOS (if the tokenizer adds one) + the snippet, repeated.

    A tokenizer that cannot spell the snippet (a toy vocabulary), or none (a random-weight model),
    gets fixed pseudo-random ids.
    """
    ids = [i for i in tokenizer.encode(SNIPPET, add_special_tokens=False) if 0 <= i < vocab_size] if tokenizer else []
    if len(set(ids)) < 8:
        ids = [(17 + 7919 * i) % vocab_size for i in range(257)]
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos", False) else None
    head = [bos] if bos is not None else []
    reps = (m_c // len(ids)) + 1
    return (head + ids * reps)[:m_c]
