"""Small helpers for the random-weight checkpoints the benchmarks (and tests) write with transformers."""

from __future__ import annotations

import json
from pathlib import Path


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over ids 0..vocab_size-1 (<unk>, <s>, </s>, then w3, w4, ...) beside a
    random checkpoint, so that `LLM(folder)` loads it as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
