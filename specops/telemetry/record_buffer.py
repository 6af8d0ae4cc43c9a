"""The runtimes' telemetry buffer between finished requests and the Redis publishers.

`RecordBuffer` queues finished requests' `DecodeRecord`s for the Redis publishers:
bounded (oldest dropped and counted past ``max_records``), flushed in order in batches of
one transaction each, and records that did not publish stay at the head of the queue for
the next flush (retried after `BACKOFF_S`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

#: seconds to wait before the next publish attempt after 1, 2, 3, ... consecutive failures
BACKOFF_S: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0)

_FAILURES = (redis.RedisError, OSError)


FLUSH_BATCH = 64
"""Records per Redis transaction when a flush finds several queued. One transaction per record
(~40 commands each, encoded in Python) took 3.4% of a `specops serve` process's CPU samples at 16
streams (py-spy), on the policy thread beside the engine's: 2.5-2.7 ms of CPU per record against
0.09-0.14 ms in batches of 64 over three classes (the embedded Redis, 256 records)."""
RECORD_FLUSH_S = 1.0
"""The servers' shortest interval between record flushes (`RecordBuffer.min_interval_s`); their
policy thread polls every 0.2 s, which at ~10 finished requests a second left ~2 per flush. The
controller reads 10 s buckets every 2 s: a record a second late moves nothing it decides on."""


class RecordBuffer:
    """Bounded queue of (canary?, DecodeRecord) for the Redis publishers (see module docstring)."""

    def __init__(self, publisher: Any = None, canary_publisher: Any = None, *, max_records: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, backoff_s: tuple[float, ...] = BACKOFF_S,
                 min_interval_s: float = 0.0) -> None:
        """``min_interval_s``: a flush sooner than this after the last one publishes nothing unless
        `FLUSH_BATCH` records wait (or ``force``), so that records go out several per transaction
        (the servers: `RECORD_FLUSH_S`)."""
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.min_interval_s = min_interval_s
        self._last_flush = float("-inf")
        self.publisher = publisher
        self.canary_publisher = canary_publisher
        self.max_records = max_records
        self.dropped = 0
        self.published = 0
        self.clock = clock
        self.backoff_s = tuple(backoff_s)
        self._failures = 0
        self._next_attempt = float("-inf")
        self._queue: deque[tuple[bool, Any, int]] = deque()  # (canary?, record, sequence number)
        self._seq = 0
        self._unsure: int | None = None  # sequence number of a record whose publish failed: applied or not?
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, record: Any, canary: bool = False) -> None:
        with self._lock:
            if len(self._queue) >= self.max_records:
                self._queue.popleft()
                self.dropped += 1
            self._seq += 1
            self._queue.append((canary, record, self._seq))

    def flush(self, force: bool = False) -> int:
        """Publish queued records oldest first until a publish fails; returns how many were published.

        Records go out in batches (`FLUSH_BATCH`, consecutive records for one publisher), one
        transaction each (`RedisPublisher.publish_many`). After a failure the next attempt waits
        out the backoff (unless ``force``).
        """
        done = 0
        now = self.clock()
        if not force and now < self._next_attempt:
            return 0
        if not force and now - self._last_flush < self.min_interval_s and len(self._queue) < FLUSH_BATCH:
            return 0
        self._last_flush = now
        with self._flush_lock:
            while True:
                with self._lock:
                    if not self._queue:
                        return done
                    canary = self._queue[0][0]
                    batch = []
                    for item in self._queue:
                        if item[0] != canary or len(batch) >= FLUSH_BATCH:
                            break
                        batch.append(item)
                publisher = self.canary_publisher if canary else self.publisher
                if publisher is not None:
                    try:
                        # a failed publish may have been applied (Redis died before replying): ask first,
                        # and drop what it carried instead of counting it twice
                        if self._unsure is not None and publisher.applied(self._unsure):
                            batch = [item for item in batch if item[2] <= self._unsure]
                        else:
                            publisher.publish_many([record for _, record, _ in batch], batch[-1][2])
                        self._unsure = None
                    except _FAILURES as exc:
                        self._unsure = batch[-1][2]
                        self._failures += 1
                        delay = self.backoff_s[min(self._failures, len(self.backoff_s)) - 1]
                        self._next_attempt = self.clock() + delay
                        log.warning("telemetry kept for later (%d queued, next try in %.2fs): %s",
                                    len(self._queue), delay, exc)
                        return done
                    self._failures = 0
                    self._next_attempt = float("-inf")
                with self._lock:
                    for _, record, _ in batch:  # those still queued (a full queue drops its oldest)
                        if self._queue and self._queue[0][1] is record:
                            self._queue.popleft()
                done += len(batch)
                self.published += len(batch)
