"""forklm: many samples from one context, fast and exact (bifurcated attention)."""

from forklm.errors import (
    ForkLMError,
    InvalidArgumentError,
    ModelFileError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from forklm.engine.engine import Engine, EngineConfig
from forklm.llm import LLM, Request
from forklm.outputs import Sample, SampleOutput, Stats
from forklm.sampling.params import SamplingParams

__all__ = [
    "LLM",
    "Engine",
    "EngineConfig",
    "Request",
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
