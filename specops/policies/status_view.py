"""What ``specops policy status`` prints: the rollout line, the class table, and ``--watch``.

`render_status` builds one snapshot (text or JSON) from the store; `watch_status`
redraws it every interval — clearing the terminal when it is one, else separating
frames with a blank line (JSON: one object per line) — until Ctrl-C, a timeout or a
number of frames, like ``kubectl argo rollouts get rollout --watch``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from specops.policies.class_status import class_statuses, status_document, status_table
from specops.policies.state import RolloutState
from specops.policies.store import PolicyStore

CLEAR = "\x1b[H\x1b[2J"


def describe_state(state: RolloutState) -> str:
    """The rollout in two lines: revision, phase, weight, analysis tally; step, stable revision, message."""
    line = f"revision {state.revision}: {state.phase}, {state.weight}% on canary"
    if state.phase == "healthy":
        line = f"revision {state.revision}: healthy (current, 100%)"
    runs = state.analysis_runs
    if runs:
        counts: dict[str, int] = {}
        for r in runs:
            counts[r.get("outcome", "?")] = counts.get(r.get("outcome", "?"), 0) + 1
        line += "; analysis " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"{line}\n  step {state.step_index}, stable revision {state.stable_revision}: {state.message}"


def render_status(store: PolicyStore, state: RolloutState, *, window_s: float, as_json: bool,
                  clock: Callable[[], float] = time.time, indent: int | None = 2) -> str:
    """One snapshot of the rollout and every class."""
    classes = class_statuses(store, window_s=window_s, clock=clock)
    if as_json:
        return json.dumps(status_document(state, classes), indent=indent)
    return describe_state(state) + "\n\n" + status_table(classes, clock(), window_s)


def watch_status(store: PolicyStore, *, window_s: float, as_json: bool, interval_s: float, timeout_s: float,
                 count: int | None, echo: Callable[..., None], clear: bool,
                 clock: Callable[[], float] = time.time) -> RolloutState:
    """Redraw until Ctrl-C, ``timeout_s`` or ``count`` frames; returns the last rollout state seen."""
    deadline = time.monotonic() + timeout_s
    state = store.rollout_state()
    frames = 0
    try:
        while True:
            state = store.rollout_state() or state
            frame = render_status(store, state, window_s=window_s, as_json=as_json, clock=clock,
                                  indent=None if as_json else 2)
            stamp = time.strftime("%H:%M:%SZ", time.gmtime(clock()))
            if as_json:
                echo(frame)
            else:
                echo((CLEAR if clear else ("\n" if frames else "")) + f"every {interval_s:g}s, {stamp}\n" + frame)
            frames += 1
            if (count is not None and frames >= count) or time.monotonic() >= deadline:
                break
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass  # Ctrl-C ends the watch; the exit status still reflects the rollout
    return state
