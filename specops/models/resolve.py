"""``--model NAME``: a registered model's name resolves to its cached folder, pulled on first use.

A path that exists wins over a registered name (a folder called ``smollm2-135m-instruct``
in the working directory is loaded as a folder).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from specops.models.registry import BF16_SUBDIR, REGISTRY, is_current, model_dir

log = logging.getLogger(__name__)


def is_registered(ref: Any) -> bool:
    """Whether ``ref`` names a registered model (and no existing path of that name)."""
    return isinstance(ref, (str, Path)) and str(ref) in REGISTRY and not Path(ref).exists()


def _is_bf16(dtype: Any) -> bool:
    return dtype is not None and str(dtype).removeprefix("torch.") == "bfloat16"


def resolve_model(ref: Any, *, dtype: Any = None, progress: bool = True) -> Any:
    """``ref`` itself, or for a registered name its converted folder (the ``bf16/`` copy for
    ``dtype`` bfloat16, given as a torch dtype or its name), pulled first when not cached."""
    if not is_registered(ref):
        return ref
    spec = REGISTRY[str(ref)]
    folder = model_dir(spec.name)
    if not is_current(spec, folder):
        message = (f"specops: model {spec.name} is not in the cache; pulling it into {folder} now (first use; "
                   f"`specops models pull {spec.name}` does this ahead of time)")
        print(message, file=sys.stderr, flush=True)
        log.info(message)
        from specops.models.pull import pull

        folder = pull(spec, progress=progress)
    return folder / BF16_SUBDIR if _is_bf16(dtype) else folder
