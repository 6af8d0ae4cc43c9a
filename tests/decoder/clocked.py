"""A fake clock for decode-deadline tests: time advances only when a model runs.

`ClockedRunner` wraps any `ModelRunner`; each forward pass logs ``(start time, T new
positions)`` and then advances the shared `FakeClock` by ``forward_s``.
`FakeClock.install` makes ``time.perf_counter`` read it (``read_s`` per read, 0 by
default) and `FakeClock.slow` makes any other callable, e.g. an n-gram lookup, take
fake time too. Deterministic and independent of how loaded the machine is. ``sleep_s`` makes a forward really slow
instead (real-time tests, with the clock left uninstalled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class FakeClock:
    now: float = 1000.0
    read_s: float = 0.0  # seconds each perf_counter() read advances time

    def perf_counter(self) -> float:
        self.now += self.read_s
        return self.now

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(time, "perf_counter", self.perf_counter)

    def slow(self, fn, seconds: float):
        """``fn`` that also advances the clock by ``seconds`` per call."""

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.now += seconds
            return out

        return wrapper


@dataclass
class Forward:
    start: float  # clock time when the forward began
    width: int  # T: new positions in this forward (1 = a plain decoding step)


@dataclass(eq=False)  # identity: runners are keys of the decoder's cost caches
class ClockedRunner:
    """A runner whose forward passes take ``forward_s`` seconds of fake time each."""

    inner: object
    clock: FakeClock
    forward_s: float = 1.0
    sleep_s: float = 0.0  # real seconds each forward also sleeps (a genuinely slow model)
    log: list[Forward] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    @property
    def device(self):
        return self.inner.device

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def cache_len(self) -> int:
        return self.inner.cache_len

    def reset(self, batch_size: int = 1) -> None:
        self.inner.reset(batch_size)

    def forward(self, input_ids, **kwargs):  # input_ids: [B, T] long
        self.log.append(Forward(start=self.clock.now, width=int(input_ids.shape[1])))
        out = self.inner.forward(input_ids, **kwargs)
        self.clock.now += self.forward_s
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return out

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)

    def compact(self, start: int, keep) -> None:  # keep: [n] long
        self.inner.compact(start, keep)
