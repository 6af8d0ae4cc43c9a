"""The KV gauges a scrape shows come from one engine snapshot: used + free is the pool."""

from __future__ import annotations

import sys
import threading

from prometheus_client import CollectorRegistry, generate_latest

from specops.engine.metrics import ServingMetrics
from specops.engine.sequence import EngineStats

POOL = 100


def _kv(text: str) -> tuple[float, float]:
    used = free = -1.0
    for line in text.splitlines():
        if line.startswith("specops_serving_kv_blocks_used "):
            used = float(line.split()[1])
        elif line.startswith("specops_serving_kv_blocks_free "):
            free = float(line.split()[1])
    return used, free


def test_a_scrape_never_shows_used_and_free_of_different_steps() -> None:
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry)
    snaps = [EngineStats(waiting=0, running=1, batch_size=1, kv_blocks_used=u, kv_blocks_free=POOL - u,
                         kv_blocks_total=POOL) for u in (3, 97)]
    metrics.engine(snaps[0])
    stop = threading.Event()

    def engine_thread() -> None:
        i = 0
        while not stop.is_set() and i < 2_000_000:
            metrics.engine(snaps[i % 2])
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    t = threading.Thread(target=engine_thread, daemon=True)
    t.start()
    try:
        seen = [_kv(generate_latest(registry).decode()) for _ in range(1500)]
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    assert {u for u, _ in seen} == {3.0, 97.0}  # both snapshots were scraped
    torn = [(u, f) for u, f in seen if u + f != POOL]
    assert not torn, f"{len(torn)}/{len(seen)} scrapes mixed two snapshots, e.g. {torn[:3]}"
