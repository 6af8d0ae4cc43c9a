"""The modes through Redis: each mode's effective settings written as an operator would, and the waits
until the server's ``/readyz`` shows them."""

from __future__ import annotations

import time
from typing import Any

from specops.bench.serve import procs
from specops.bench.serve.config import TWIN, BenchServeError


def _expected(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What the server's ``/readyz`` shows per class once it applied ``settings`` (class -> EffectiveSettings)."""
    return {k: {"method": v.method, "gamma": v.gamma, "medusa_heads": v.medusa_heads, "fallback": v.fallback_active}
            for k, v in settings.items()}


def _apply_mode(store: Any, mode: str) -> dict[str, dict[str, Any]]:
    """Write the mode's effective settings (an operator action); returns what `_wait_settings` waits for."""
    from dataclasses import replace

    from specops.policies.rollout import effective_for

    rev = store.current_revision()
    if rev is None:
        raise BenchServeError("the server's Redis holds no current policy revision")
    settings = effective_for(store.get_revision(rev).policy, rev, time.time())
    if mode in ("off", TWIN):
        settings = {k: replace(v, method="off") for k, v in settings.items()}
    store.set_effective(settings, epoch=None, reason=f"bench serve: mode {mode}", replace=True, actor="bench")
    return _expected(settings)


def _restore_adaptive(store: Any, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One server: put back the settings the controller had when its last cell ended."""
    if not settings:
        raise BenchServeError("the server's Redis held no effective settings after the adaptive mode's cell")
    store.set_effective(settings, epoch=None, reason="bench serve: mode adaptive (the controller's settings back)",
                        replace=True, actor="bench")
    return _expected(settings)


def _wait_settings(url: str, expected: dict[str, Any], timeout_s: float = 30.0) -> None:
    """Until ``/readyz`` shows ``expected``: class -> method, or class -> the fields `_expected` lists."""
    def shows(live: dict[str, Any], want: Any) -> bool:
        if isinstance(want, str):
            return live.get("method") == want
        return all(live.get(k) == v for k, v in want.items())

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        classes = procs._wait_ready(url, timeout_s)["policy"].get("classes", {})
        if all(shows(classes.get(k, {}), want) for k, want in expected.items()):
            return
        time.sleep(0.3)
    raise BenchServeError(f"the server did not apply the settings within {timeout_s:.0f}s")


def _settings_text(url: str) -> dict[str, str]:
    """Each class's live setting as the server reports it (``/readyz``), e.g. ``draft γ8``."""
    out = {}
    for name, c in sorted(procs._wait_ready(url, 30)["policy"].get("classes", {}).items()):
        text = c.get("method") or "?"
        if c.get("fallback"):
            text += " (fallback)"
        elif text == "medusa" and c.get("medusa_heads"):
            text += f" h{c['medusa_heads']}"
        elif text not in ("off", "ar") and c.get("gamma"):
            text += f" γ{c['gamma']}"
        out[name] = text
    return out
