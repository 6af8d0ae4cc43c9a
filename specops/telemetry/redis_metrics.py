"""The telemetry counters in Redis, in time buckets, so the controller reads windows without Prometheus.

Layout (``ns`` = ``{namespace}``, a Redis Cluster hash tag: :mod:`specops.telemetry.keyspace`;
``b`` = bucket number = floor(unix time / bucket_s)):

``{ns}:tm:pod:{class}:{pod}:{b}``  hash  one pod's sums for one class in one bucket
``{ns}:tm:agg:{class}:{b}``        hash  the same sums over all pods (what a controller tick reads)
``{ns}:tm:classes``                zset  class -> last time a record arrived
``{ns}:tm:pods:{class}``           zset  pod -> last time it published for the class

Every bucket hash expires ``ttl_s`` after its last write. A publish is one MULTI/EXEC
(HINCRBY/HINCRBYFLOAT on both hashes), so readers never see half a record; a batch of
records (`RedisPublisher.publish_many`) is one too, its fields summed per class first.

A publish given a sequence number (`RecordBuffer` numbers its records) also sets
``{ns}:tm:applied:{pod}:{boot}`` (``boot``: one id per publisher object) to that number
in the same transaction. When Redis dies after applying a transaction but before its
reply arrives, the retry asks `applied` first and skips the record instead of counting
it twice (found by ``specops chaos``: SIGKILLed Redis, one record duplicated). Reading a
window of W seconds for C classes is ``C × ceil(W / bucket_s)`` HGETALLs in one round
trip, independent of the number of pods: 5 classes × a 60 s window at 10 s buckets is
30 small hashes.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable

from specops.telemetry.keyspace import key_prefix
from specops.telemetry.records import DecodeRecord, WindowStats

_INT_FIELDS = ("requests", "new_tokens", "drafted", "accepted", "target_forwards", "planned")
_FLOAT_FIELDS = ("draft_s", "verify_s", "wall_s", "plain_s_estimate", "gamma_sum", "heads_sum")
_ACCEPTED_POS = "app:"
_DRAFTED_POS = "dpp:"
_HEAD_PRED = "hp:"
_HEAD_CORRECT = "hc:"
_FALLBACK = "fb:"


def _check_period(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


class _Keys:
    def __init__(self, namespace: str) -> None:
        self.ns = key_prefix(namespace)

    def pod(self, request_class: str, pod: str, bucket: int) -> str:
        return f"{self.ns}:tm:pod:{request_class}:{pod}:{bucket}"

    def agg(self, request_class: str, bucket: int) -> str:
        return f"{self.ns}:tm:agg:{request_class}:{bucket}"

    @property
    def classes(self) -> str:
        return f"{self.ns}:tm:classes"

    def pods(self, request_class: str) -> str:
        return f"{self.ns}:tm:pods:{request_class}"


def _record_fields(record: DecodeRecord) -> tuple[dict[str, int], dict[str, float]]:
    ints = {
        "requests": 1,
        "new_tokens": record.new_tokens,
        "drafted": record.drafted,
        "accepted": record.accepted,
        "target_forwards": record.target_forwards,
        "planned": int(record.planned),
    }
    for i, n in enumerate(record.accepted_per_pos):
        ints[f"{_ACCEPTED_POS}{i}"] = n
    for i, n in enumerate(record.drafted_per_pos):
        ints[f"{_DRAFTED_POS}{i}"] = n
    for i, (p, c) in enumerate(zip(record.head_predictions, record.head_correct)):
        ints[f"{_HEAD_PRED}{i}"] = p
        ints[f"{_HEAD_CORRECT}{i}"] = c
    if record.fallback_reason:
        ints[f"{_FALLBACK}{record.fallback_reason}"] = 1
    floats = {
        "draft_s": record.draft_s,
        "verify_s": record.verify_s,
        "wall_s": record.wall_s,
        "plain_s_estimate": record.plain_s_estimate,
        "gamma_sum": float(record.gamma),
        "heads_sum": float(record.heads),
    }
    return ints, floats


class RedisPublisher:
    """Publishes each pod's `DecodeRecord`s into the bucketed hashes (see the module doc)."""

    def __init__(self, redis, pod: str, bucket_s: float = 10, ttl_s: float = 3600,
                 clock: Callable[[], float] = time.time, namespace: str = "specops") -> None:
        if not pod:
            raise ValueError("pod must be a non-empty name")
        _check_period("bucket_s", bucket_s)
        _check_period("ttl_s", ttl_s)
        if ttl_s < bucket_s:
            raise ValueError(f"ttl_s ({ttl_s}) must be at least bucket_s ({bucket_s})")
        self.redis = redis
        self.pod = pod
        self.bucket_s = bucket_s
        self.ttl_s = ttl_s
        self.clock = clock
        self._keys = _Keys(namespace)
        self._applied_key = f"{key_prefix(namespace)}:tm:applied:{pod}:{uuid.uuid4().hex[:12]}"

    def applied(self, seq: int) -> bool:
        """Whether the record published with sequence number ``seq`` (or a later one) is in Redis."""
        raw = self.redis.get(self._applied_key)
        return raw is not None and int(raw) >= seq

    def publish(self, record: DecodeRecord, seq: int | None = None) -> None:
        """Add one record to the current bucket of its class (atomically, with expiry);
        ``seq`` (increasing per publisher) is recorded with it for `applied`."""
        self.publish_many([record], seq)

    def publish_many(self, records: Iterable[DecodeRecord], seq: int | None = None) -> None:
        """Add records to the current buckets of their classes in one MULTI/EXEC: each class's
        fields are summed here first, so the transaction has one HINCRBY per field and class
        whatever the number of records (what a reader sees is the same as one publish per
        record). ``seq``: the last record's sequence number, for `applied`."""
        now = self.clock()
        bucket = int(now // self.bucket_s)
        sums: dict[str, tuple[dict[str, int], dict[str, float]]] = {}
        for record in records:
            ints, floats = _record_fields(record)
            if record.request_class not in sums:
                sums[record.request_class] = (ints, floats)
                continue
            total_i, total_f = sums[record.request_class]
            for name, value in ints.items():
                total_i[name] = total_i.get(name, 0) + value
            for name, value in floats.items():
                total_f[name] += value
        if not sums:
            return
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=True)
        for request_class, (ints, floats) in sums.items():
            for key in (self._keys.pod(request_class, self.pod, bucket), self._keys.agg(request_class, bucket)):
                for name, value in ints.items():
                    pipe.hincrby(key, name, value)
                for name, value in floats.items():
                    pipe.hincrbyfloat(key, name, value)
                pipe.pexpire(key, ttl_ms)
            for index, member in ((self._keys.classes, request_class), (self._keys.pods(request_class), self.pod)):
                pipe.zadd(index, {member: now})
                pipe.zremrangebyscore(index, "-inf", now - self.ttl_s)  # forget long-silent classes / pods
        if seq is not None:
            pipe.set(self._applied_key, seq, px=ttl_ms)
        pipe.execute()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _indexed(counts: dict[int, int]) -> list[int]:
    return [counts.get(i, 0) for i in range(max(counts) + 1)] if counts else []


def _stats_from_hashes(hashes: Iterable[dict]) -> WindowStats:
    """Sum bucket hashes (raw HGETALL replies) into one window."""
    ints = dict.fromkeys(_INT_FIELDS, 0)
    floats = dict.fromkeys(_FLOAT_FIELDS, 0.0)
    pos: dict[int, int] = {}
    pred: dict[int, int] = {}
    corr: dict[int, int] = {}
    fallbacks: dict[str, int] = {}
    dpos: dict[int, int] = {}
    for raw in hashes:
        for k, v in raw.items():
            name, value = _text(k), _text(v)
            if name in ints:
                ints[name] += int(value)
            elif name in floats:
                floats[name] += float(value)
            elif name.startswith(_DRAFTED_POS):
                i = int(name[len(_DRAFTED_POS):])
                dpos[i] = dpos.get(i, 0) + int(value)
            elif name.startswith(_ACCEPTED_POS):
                i = int(name[len(_ACCEPTED_POS):])
                pos[i] = pos.get(i, 0) + int(value)
            elif name.startswith(_HEAD_PRED):
                i = int(name[len(_HEAD_PRED):])
                pred[i] = pred.get(i, 0) + int(value)
            elif name.startswith(_HEAD_CORRECT):
                i = int(name[len(_HEAD_CORRECT):])
                corr[i] = corr.get(i, 0) + int(value)
            elif name.startswith(_FALLBACK):
                reason = name[len(_FALLBACK):]
                fallbacks[reason] = fallbacks.get(reason, 0) + int(value)
    n_heads = max(len(_indexed(pred)), len(_indexed(corr)))
    requests = ints["requests"]
    return WindowStats(
        requests=requests,
        new_tokens=ints["new_tokens"],
        drafted=ints["drafted"],
        accepted=ints["accepted"],
        accepted_per_pos=_indexed(pos),
        target_forwards=ints["target_forwards"],
        draft_s=floats["draft_s"],
        verify_s=floats["verify_s"],
        wall_s=floats["wall_s"],
        plain_s_estimate=floats["plain_s_estimate"],
        head_predictions=[pred.get(i, 0) for i in range(n_heads)],
        head_correct=[corr.get(i, 0) for i in range(n_heads)],
        gamma=floats["gamma_sum"] / requests if requests else 0.0,
        heads=floats["heads_sum"] / requests if requests else 0.0,
        fallbacks=fallbacks,
        drafted_per_pos=_indexed(dpos),
        planned=ints["planned"],
    )


class RedisWindowReader:
    """Reads recent windows of the bucketed counters (fleet-wide, or one pod)."""

    def __init__(self, redis, bucket_s: float = 10, clock: Callable[[], float] = time.time,
                 namespace: str = "specops", ttl_s: float = 3600) -> None:
        _check_period("bucket_s", bucket_s)
        _check_period("ttl_s", ttl_s)
        self.redis = redis
        self.bucket_s = bucket_s
        self.clock = clock
        self.ttl_s = ttl_s
        self._keys = _Keys(namespace)

    def _buckets(self, seconds: float) -> range:
        """The buckets covering the last ``seconds`` (the current, partial one included)."""
        _check_period("seconds", seconds)
        last = int(self.clock() // self.bucket_s)
        count = max(1, math.ceil(seconds / self.bucket_s))
        return range(last - count + 1, last + 1)

    def window(self, request_class: str, seconds: float, pod: str | None = None) -> WindowStats:
        """Sums for ``request_class`` over the last ``seconds`` (all pods, or only ``pod``)."""
        buckets = self._buckets(seconds)
        pipe = self.redis.pipeline(transaction=False)
        for b in buckets:
            pipe.hgetall(self._keys.agg(request_class, b) if pod is None else self._keys.pod(request_class, pod, b))
        return _stats_from_hashes(pipe.execute())

    def windows(self, request_classes: Iterable[str], seconds: float) -> dict[str, WindowStats]:
        """Fleet-wide windows for several classes in ONE round trip (a controller tick)."""
        names = list(request_classes)
        buckets = self._buckets(seconds)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            for b in buckets:
                pipe.hgetall(self._keys.agg(name, b))
        replies = pipe.execute()
        n = len(buckets)
        return {name: _stats_from_hashes(replies[i * n:(i + 1) * n]) for i, name in enumerate(names)}

    def classes(self) -> list[str]:
        """Classes that published within the expiry period, sorted by name."""
        since = self.clock() - self.ttl_s
        return sorted(_text(m) for m in self.redis.zrangebyscore(self._keys.classes, since, "+inf"))

    def pods(self, request_class: str) -> list[str]:
        """Pods that published for ``request_class`` within the expiry period."""
        since = self.clock() - self.ttl_s
        return sorted(_text(m) for m in self.redis.zrangebyscore(self._keys.pods(request_class), since, "+inf"))
