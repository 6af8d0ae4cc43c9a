"""Errors raised by the decoding runtime.

Every bad input raises a real exception (never an ``assert``) whose message names the
problem and the offending value, so a caller can fix the request without reading
the source. All of them derive from `DecoderError`; the ones caused by the caller's
arguments are also `ValueError`s so generic validation code can catch them.
"""

from __future__ import annotations


class DecoderError(Exception):
    """Base class of every error `specops.decoder` and `specops.spec` raise."""


class InvalidRequestError(DecoderError, ValueError):
    """A ``generate`` argument is invalid (empty prompt, temperature < 0, γ < 1, ...)."""


class UnknownMethodError(InvalidRequestError):
    """``method=`` names no decoding method the runtime knows."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""


class VocabMismatchError(DecoderError, ValueError):
    """Draft and target models do not share one vocabulary."""


class ModelLoadError(DecoderError):
    """A target, draft or Medusa artifact could not be loaded."""


class MissingComponentError(InvalidRequestError):
    """The requested method needs a component (draft model, Medusa heads) the decoder lacks."""
