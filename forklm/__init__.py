"""forklm: many samples from one context, fast and exact (bifurcated attention)."""

from forklm.errors import (
    ForkLMError,
    InvalidArgumentError,
    ModelFileError,
    ModelOutputError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from forklm.engine.engine import Engine, EngineConfig
from forklm.llm import LLM, Request
from forklm.outputs import Sample, SampleOutput, Stats
from forklm.sampling.params import SamplingOptions, SamplingParams

__all__ = [
    "LLM",
    "Engine",
    "EngineConfig",
    "Request",
    "Sample",
    "SampleOutput",
    "SamplingOptions",
    "SamplingParams",
    "Stats",
    "ForkLMError",
    "InvalidArgumentError",
    "ModelFileError",
    "ModelOutputError",
    "OutOfMemoryError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
