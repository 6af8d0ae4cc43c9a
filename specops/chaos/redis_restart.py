"""Redis SIGKILLed and restarted N times while ``specops serve`` takes steady load.

Figures: failed requests (anything but 200 from the server), lost policy revisions
and audit records (written by this driver, acknowledged by Redis, missing after the
last restart), lost / duplicated telemetry records (per-request records the server
published to Redis, against the requests it answered 200). Redis runs with an
append-only file fsynced on every write, so an acknowledged write must survive a
SIGKILL; the server buffers records while Redis is down and flushes them after.
"""

from __future__ import annotations

import threading
import time

import httpx
import redis

from specops.chaos.procs import wait_until
from specops.chaos.result import ScenarioResult
from specops.chaos.rig import NAMESPACE, POLICY, Rig

NAME = "redis killed and restarted under load"


def _client(rig: Rig) -> redis.Redis:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # no client-side retries: a write either is acknowledged now or counts as refused
    return redis.Redis(host="127.0.0.1", port=rig.redis_port, socket_timeout=1.0, socket_connect_timeout=1.0,
                       retry=Retry(NoBackoff(), 0))


def _published(rig: Rig) -> int:
    from specops.telemetry.redis_metrics import RedisWindowReader

    client = _client(rig)
    try:
        reader = RedisWindowReader(client, namespace=NAMESPACE)
        return sum(reader.window(c, 3600).requests for c in reader.classes())
    finally:
        client.close()


class _Writer(threading.Thread):
    """Writes a policy revision and an audit record every ``every_s``; keeps what Redis acknowledged."""

    def __init__(self, rig: Rig, every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        from specops.policies import load_policy
        from specops.policies.loader import read_source

        self.rig, self.every_s = rig, every_s
        self.policy = load_policy(str(POLICY))
        self.text, _ = read_source(str(POLICY))
        self.revisions: list[int] = []
        self.audits: list[int] = []
        self.refused = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from specops.policies.errors import StoreUnavailableError
        from specops.policies.store import PolicyStore

        n = 0
        while not self.stop.is_set():
            n += 1
            client = _client(self.rig)
            store = PolicyStore(client, namespace=NAMESPACE)
            try:
                self.revisions.append(store.put_revision(self.policy, self.text, actor="chaos"))
                store.commit(epoch=None, actor="chaos", audit=("chaos.probe", {"n": n}))
                self.audits.append(n)
            except (StoreUnavailableError, redis.RedisError):
                self.refused += 1  # not acknowledged: nothing to count as lost
            except Exception as exc:  # anything else is a finding, reported with the figures
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                client.close()
            self.stop.wait(self.every_s)


def run(rig: Rig, *, cycles: int, down_s: float) -> ScenarioResult:
    rig.ensure_serve()
    wait_until(lambda: rig.ready()["policy"]["records_buffered"] == 0, "an empty record buffer", 30)
    baseline = _published(rig)
    ok, failed = [0], []
    stop = threading.Event()

    def load(i: int) -> None:
        with httpx.Client(timeout=60, headers=rig.auth) as c:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    r = c.post(f"{rig.serve.url}/v1/completions",
                               json={"prompt": f"def chaos_{i}_{n}(x):", "max_tokens": 4, "temperature": 0})
                    if r.status_code == 200:
                        ok[0] += 1
                    else:
                        failed.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    failed.append(repr(exc))

    writer = _Writer(rig)
    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(2)]
    served_during_outage = 0
    for t in [*threads, writer]:
        t.start()
    try:
        wait_until(lambda: ok[0] >= 3, "load before the first outage", 60)
        for _ in range(cycles):
            rig.redis.kill()  # SIGKILL: only the fsynced append-only file survives
            before = ok[0]
            wait_until(lambda: rig.ready()["policy"]["stale_reason"] == "redis_unreachable",
                       "the server to notice the outage", 30)
            time.sleep(down_s)
            wait_until(lambda: ok[0] >= before + 2, "requests served while Redis is down", 60)
            served_during_outage += ok[0] - before
            rig.start_redis()  # same port, same directory
            wait_until(lambda: rig.ready()["policy"]["live"], "the server live again", 30)
            after = ok[0]
            wait_until(lambda: ok[0] >= after + 2, "requests after the restart", 60)
    finally:
        stop.set()
        writer.stop.set()
        for t in [*threads, writer]:
            t.join(60)
    wait_until(lambda: rig.ready()["policy"]["records_buffered"] == 0, "the record buffer to flush", 60)
    published = _published(rig) - baseline

    from specops.policies.store import PolicyStore

    client = _client(rig)
    try:
        store = PolicyStore(client, namespace=NAMESPACE)
        stored = {int(k) for k in client.hkeys(store.names.revisions)}
        probes = {e.get("n") for e in store.read_audit(count=10_000) if e.get("kind") == "chaos.probe"}
    finally:
        client.close()
    lost_revisions = len(set(writer.revisions) - stored)
    lost_audit = len(set(writer.audits) - probes)
    figures = {
        "restarts": cycles,
        "requests_ok": ok[0],
        "served_while_down": served_during_outage,
        "failed_requests": len(failed),
        "revisions_acked": len(writer.revisions),
        "lost_revisions": lost_revisions,
        "audit_acked": len(writer.audits),
        "lost_audit_records": lost_audit,
        "writes_refused_while_down": writer.refused,
        "writer_errors": len(writer.errors),
        "telemetry_lost": max(0, ok[0] - published),
        "telemetry_duplicated": max(0, published - ok[0]),
    }
    met = (figures["failed_requests"] == 0 and lost_revisions == 0 and lost_audit == 0
           and published == ok[0] and len(writer.revisions) > 0 and len(writer.audits) > 0 and not writer.errors)
    return ScenarioResult(NAME, figures, "0 failed / 0 lost revisions / 0 lost audit / 0 lost or duplicated records",
                          met, notes=failed[:3] + writer.errors[:3])
