"""specops.decoder: lossless speculative decoding on transformers models.

Public API: `Decoder` (``generate`` with methods ar / draft / ngram / medusa),
`GenerateOutput`, `DecodeStats`, `SamplingConfig` and the errors in
`specops.decoder.errors`. Submodules are one concept each: ``sampling`` (filters),
``verify`` (acceptance rules), ``schedule`` (γ schedules), ``autoregressive``,
``draft``, ``ngram`` (the methods), ``runner`` (models behind one interface).
"""

from specops.decoder.api import Decoder, GenerateOutput
from specops.decoder.errors import (
    ContextLengthError,
    DecoderError,
    InvalidRequestError,
    MissingComponentError,
    ModelLoadError,
    UnknownMethodError,
    VocabMismatchError,
)
from specops.decoder.medusa_heads import MedusaHeads
from specops.decoder.sampling import SamplingConfig
from specops.decoder.stats import DecodeStats

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
