"""The ``peers`` extra in tests: skip with the reason when absent, fail when CI requires it."""

from __future__ import annotations

import importlib

import pytest

from tests.services import REQUIRE_SERVICES


def require_module(name: str):
    """Import ``name`` (a module of the peers extra) or skip / fail (``SPECOPS_REQUIRE_SERVICES=1``)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as exc:
        msg = f"{name} is not installed ({exc}); pip install -e \".[peers]\" brings it"
        if REQUIRE_SERVICES:
            pytest.fail(msg + " (SPECOPS_REQUIRE_SERVICES=1: .ci/run must install the peers extra)")
        pytest.skip(msg)
