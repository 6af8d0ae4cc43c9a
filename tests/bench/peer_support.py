"""The ``peers`` extra in tests: skip with the reason when absent, fail when CI requires it."""

from __future__ import annotations

import importlib

from tests.services import missing_service


def require_module(name: str):
    """Import ``name`` (a module of the peers extra), or skip / fail (``SPECOPS_REQUIRE_SERVICES=1``)
    through the same rule as every other service (`tests.services.missing_service`)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as exc:
        missing_service(f"{name} is not installed ({exc}); pip install -e \".[peers]\" (make peers) brings it")
