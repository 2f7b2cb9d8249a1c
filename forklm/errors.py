"""Errors forklm raises for bad input. Each message names the argument or file and what is allowed."""


class ForkLMError(Exception):
    """Base class of forklm's own errors."""


class InvalidArgumentError(ForkLMError, ValueError):
    """An argument is outside what is allowed; the message names it."""


class UnsupportedModelError(ForkLMError, ValueError):
    """A model architecture, file type or tensor type forklm does not support."""


class ModelFileError(ForkLMError, ValueError):
    """A model file exists but cannot be read (corrupt, truncated, inconsistent)."""


class OutOfMemoryError(ForkLMError, MemoryError):
    """A request needs more memory than the device has; raised before allocating."""


class ModelOutputError(ForkLMError, RuntimeError):
    """The model computed something no token can be drawn from (NaN / inf logits); the request stops."""
