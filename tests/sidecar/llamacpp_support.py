"""The llama.cpp binaries for the tests: the cached `make peers` build, or skip (fail under CI)."""

from __future__ import annotations

import subprocess
from functools import lru_cache

from specops.bench.llamacpp_build import BUILD_HINT, LlamaBuildError, find_binary
from tests.services import missing_service


def require_llama_binary(name: str = "llama-server") -> str:
    """Path of a built llama.cpp binary; skipped (failed with SPECOPS_REQUIRE_SERVICES=1) when not built."""
    try:
        path = find_binary(name)
    except LlamaBuildError as exc:
        missing_service(str(exc))
    if path is None:
        missing_service(f"{name} is not built ({BUILD_HINT})")
    return path


@lru_cache(maxsize=4)
def help_text(path: str) -> str:
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr
