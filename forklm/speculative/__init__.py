"""Batched speculative sampling (BASS) inside the engine: drafters, exact verification, draft length.

`config.py` (SpeculativeConfig), `ngram.py` (a drafter without weights: continuations of a
sample's last tokens found in its prompt and its sibling samples), `draft_length.py` (BASS
Algorithm 1, a fixed length, and the measured cost rule), `verify.py` (pure functions: point-mass
acceptance and modified rejection sampling), `speculator.py` (the engine's owner of all of it).
"""

from forklm.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
