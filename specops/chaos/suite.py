"""The chaos suite: which scenarios run, at which size, and the report.

``quick`` sizes keep the whole suite within about two minutes on a small, busy
machine (the figures' goals are counts, never timings); the full sizes are what
``make chaos`` runs. Every process is stopped by PID in ``finally`` (also on Ctrl-C).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specops.chaos import (
    auth,
    disconnect,
    leader_kill,
    policy_fuzz,
    prom_outage,
    redis_pause,
    redis_restart,
    saturation,
    webhook_fuzz,
)
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import Rig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sizes:
    redis_restarts: int
    redis_down_s: float
    leader_kills: int
    redis_pauses: int
    disconnects: int
    fuzz_bodies: int
    saturation_s: float
    policies: int
    prom_outages: tuple[tuple[str, bool], ...]  # (kill | stop, long?)
    openapi_examples: int  # schemathesis cases per operation and mode (positive, negative)
    openapi_cap_tokens: int | None  # generation length of serve's fuzz cases lowered to this (None: as generated)


QUICK = Sizes(redis_restarts=2, redis_down_s=0.5, leader_kills=2, redis_pauses=1, disconnects=10, fuzz_bodies=150,
              saturation_s=5.0, policies=200, prom_outages=(("kill", True),),
              openapi_examples=3, openapi_cap_tokens=4)
FULL = Sizes(redis_restarts=10, redis_down_s=2.0, leader_kills=10, redis_pauses=5, disconnects=100,
             fuzz_bodies=10_000, saturation_s=60.0, policies=10_000,
             prom_outages=(("kill", True), ("kill", False), ("stop", False), ("stop", True), ("kill", True)),
             openapi_examples=100, openapi_cap_tokens=None)

# name -> runner; the order is the report's order.
SCENARIOS: dict[str, Callable[[Rig, Sizes], ScenarioResult]] = {
    "redis-restart": lambda rig, s: redis_restart.run(rig, cycles=s.redis_restarts, down_s=s.redis_down_s),
    "leader-kill": lambda rig, s: leader_kill.run(rig, kills=s.leader_kills),
    "redis-pause": lambda rig, s: redis_pause.run(rig, pauses=s.redis_pauses, pause_s=3.0),
    "prom-outage": lambda rig, s: prom_outage.run(rig, outages=list(s.prom_outages)),
    "saturation": lambda rig, s: saturation.run(rig, seconds=s.saturation_s),
    "disconnect": lambda rig, s: disconnect.run(rig, clients=s.disconnects),
    "webhook-fuzz": lambda rig, s: webhook_fuzz.run(rig, bodies=s.fuzz_bodies,
                                                     openapi_examples=s.openapi_examples,
                                                     cap_tokens=s.openapi_cap_tokens),
    "auth": lambda rig, s: auth.run(rig),
    "policy-fuzz": lambda rig, s: policy_fuzz.run(rig, cases=s.policies),
}


def run_suite(*, quick: bool, only: list[str] | None = None, workdir: Path | None = None,
              progress: Callable[[str], None] = lambda _: None) -> list[ScenarioResult]:
    """Run the selected scenarios (all by default) and return their results, in order."""
    names = list(SCENARIOS) if not only else only
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    sizes = QUICK if quick else FULL
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specops-chaos-")
        workdir = Path(tmp.name)
    rig = Rig(workdir)
    results: list[ScenarioResult] = []
    try:
        for name in names:
            t0 = time.monotonic()
            progress(f"{name}: running")
            try:
                result = SCENARIOS[name](rig, sizes)
            except Exception as exc:  # a scenario that could not finish did not meet its goal
                log.exception("scenario %s failed", name)
                result = ScenarioResult(name, {"error": f"{type(exc).__name__}: {exc}"[:300]}, "runs to the end",
                                        False)
            result.figures["seconds"] = round(time.monotonic() - t0, 1)
            progress(f"{name}: {'met' if result.met else 'NOT met'} {result.figures}")
            results.append(result)
    finally:
        rig.close()
        if tmp is not None:
            tmp.cleanup()
    return results


def write_json(results: list[ScenarioResult], path: str) -> None:
    Path(path).write_text(json.dumps({"scenarios": [r.as_dict() for r in results]}, indent=2) + "\n")
