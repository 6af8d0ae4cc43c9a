"""Running ``Controller.tick`` periodically with APScheduler 3.x.

One interval job, ``coalesce=True`` (missed runs collapse into one) and
``max_instances=1`` (a slow tick is never overlapped by the next). A tick that raises
is logged and the job keeps running: a Redis blip must not stop the control loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler
from apscheduler.schedulers.blocking import BlockingScheduler

log = logging.getLogger(__name__)

JOB_ID = "specops-controller-tick"


def safe_tick(tick: Callable[[], object]) -> Callable[[], None]:
    """Wrap ``tick`` so an exception is logged instead of killing the job."""

    def run() -> None:
        try:
            tick()
        except Exception:  # the loop must survive any single failed tick
            log.exception("controller tick failed; retrying at the next interval")

    return run


def build_scheduler(tick: Callable[[], object], interval_s: float, *, blocking: bool = False,
                    start_now: bool = True) -> BaseScheduler:
    """A scheduler with the controller's interval job added (not started)."""
    if interval_s <= 0:
        raise ValueError(f"interval must be positive, got {interval_s}")
    scheduler: BaseScheduler = BlockingScheduler(timezone=timezone.utc) if blocking else \
        BackgroundScheduler(timezone=timezone.utc)
    scheduler.add_job(safe_tick(tick), "interval", seconds=interval_s, id=JOB_ID, coalesce=True, max_instances=1,
                      misfire_grace_time=max(1, int(interval_s)),
                      next_run_time=datetime.now(timezone.utc) if start_now else None)
    return scheduler
