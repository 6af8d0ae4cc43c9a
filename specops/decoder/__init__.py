"""specops.decoder: lossless speculative decoding on transformers models (the public API).

Public API: `Decoder` (``generate`` with methods ar / draft / ngram / medusa / eagle / auto),
`GenerateOutput`, `DecodeStats`, `SamplingConfig`, `MedusaHeads` and the errors
(defined in `specops.spec.errors`), all importable from here.

`Decoder` (``api``) loads the models and dispatches each request; the speculative step,
its proposers and its acceptance rules are in `specops.spec`, and how a model runs
(runners, KV cache, drafter and heads modules with their checkpoint IO) in `specops.models`.
"""

from specops.decoder.api import Decoder, GenerateOutput
from specops.models.medusa_heads import MedusaHeads
from specops.spec.errors import (
    ContextLengthError,
    DecoderError,
    InvalidRequestError,
    MissingComponentError,
    ModelLoadError,
    UnknownMethodError,
    VocabMismatchError,
)
from specops.spec.sampling import SamplingConfig
from specops.spec.stats import DecodeStats

__all__ = [
    "ContextLengthError",
    "DecodeStats",
    "Decoder",
    "DecoderError",
    "GenerateOutput",
    "InvalidRequestError",
    "MedusaHeads",
    "MissingComponentError",
    "ModelLoadError",
    "SamplingConfig",
    "UnknownMethodError",
    "VocabMismatchError",
]
