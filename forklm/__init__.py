"""forklm: many samples from one context, fast and exact (bifurcated attention)."""

from forklm.errors import (
    ForkLMError,
    InvalidArgumentError,
    ModelFileError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from forklm.llm import LLM
from forklm.outputs import Sample, SampleOutput, Stats
from forklm.sampling.params import SamplingParams

__all__ = [
    "LLM",
    "Sample",
    "SampleOutput",
    "SamplingParams",
    "Stats",
    "ForkLMError",
    "InvalidArgumentError",
    "ModelFileError",
    "OutOfMemoryError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
