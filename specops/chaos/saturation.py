"""``specops serve`` at twice its saturation: 2 × (max_batch + max_queue) clients streaming at once.

Figures: requests answered 200, 429s and how many of them lacked ``Retry-After``,
any other status (5xx), p99 time to first token of the admitted streams, peak RSS of
the server during the load against a budget (its idle RSS plus ``RSS_HEADROOM_MB``,
a budget chosen here: the KV cache is preallocated, so load should add little), and
samples of ``/metrics`` where KV blocks in use exceeded the pool.
"""

from __future__ import annotations

import threading
import time

import httpx

from specops.chaos.result import ScenarioResult
from specops.chaos.rig import Rig

NAME = "serving at 2x saturation"
RSS_HEADROOM_MB = 256


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _kv(rig: Rig) -> tuple[float, float]:
    used = free = 0.0
    for line in httpx.get(f"{rig.serve.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("specops_serving_kv_blocks_used "):
            used = float(line.split()[1])
        elif line.startswith("specops_serving_kv_blocks_free "):
            free = float(line.split()[1])
    return used, free


def run(rig: Rig, *, seconds: float, max_batch: int = 2, max_queue: int = 4) -> ScenarioResult:
    rig.ensure_serve()
    ready = rig.ready()["engine"]
    pool = ready["kv_blocks_used"] + ready["kv_blocks_free"]
    clients = 2 * ready.get("max_inflight", max_batch + max_queue)
    pid = rig.serve.popen.pid
    idle_rss = _rss_mb(pid)
    ok, rejected, no_retry_after, other, errors, ttft = [0], [0], [0], [], [], []
    peak_rss, kv_over, samples = [idle_rss], [0], [0]
    stop = threading.Event()
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": f"def saturate_{i}(x):", "max_tokens": 16, "temperature": 0, "stream": True}
        with httpx.Client(timeout=120, headers=rig.auth) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    with c.stream("POST", f"{rig.serve.url}/v1/completions", json=body) as r:
                        if r.status_code == 429:
                            with lock:
                                rejected[0] += 1
                                no_retry_after[0] += "retry-after" not in r.headers
                            r.read()
                            stop.wait(0.05)
                            continue
                        if r.status_code != 200:
                            with lock:
                                other.append(r.status_code)
                            r.read()
                            continue
                        first = None
                        for line in r.iter_lines():
                            if first is None and line.startswith("data: {"):
                                first = time.monotonic() - t0
                        with lock:
                            ok[0] += 1
                            if first is not None:
                                ttft.append(first)
                except httpx.HTTPError as exc:
                    with lock:
                        errors.append(repr(exc))

    def watch() -> None:
        while not stop.is_set():
            try:
                peak_rss[0] = max(peak_rss[0], _rss_mb(pid))
                used, free = _kv(rig)
                samples[0] += 1
                kv_over[0] += used > pool or used + free > pool
            except (OSError, httpx.HTTPError):
                pass
            stop.wait(0.2)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    threads.append(threading.Thread(target=watch, daemon=True))
    for t in threads:
        t.start()
    try:
        stop.wait(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    ttft.sort()
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None
    budget = idle_rss + RSS_HEADROOM_MB
    figures = {"clients": clients, "load_s": seconds, "ok": ok[0], "429": rejected[0],
               "429_without_retry_after": no_retry_after[0], "other_status": len(other),
               "transport_errors": len(errors), "p99_ttft_s": round(p99, 3) if p99 is not None else None,
               "peak_rss_mb": round(peak_rss[0]), "rss_budget_mb": round(budget), "kv_pool_blocks": pool,
               "kv_over_budget_samples": f"{kv_over[0]}/{samples[0]}"}
    met = (ok[0] > 0 and rejected[0] > 0 and no_retry_after[0] == 0 and not other and not errors
           and peak_rss[0] <= budget and kv_over[0] == 0 and samples[0] > 0)
    return ScenarioResult(NAME, figures, "429s all with Retry-After, 0 other errors, RSS within budget, "
                          "0 KV over budget", met, notes=[str(s) for s in other[:3]] + errors[:3])
