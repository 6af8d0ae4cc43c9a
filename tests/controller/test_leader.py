"""LeaderLease on a real Redis: one leader at a time, takeover within a TTL, rising fencing epochs."""

from __future__ import annotations

import threading
import time

import pytest

from specops.controller.leader import LeaderLease


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_exactly_one_of_two_leads(redis_client):
    a = LeaderLease(redis_client, "t:leader", ttl_ms=5000, holder="a")
    b = LeaderLease(redis_client, "t:leader", ttl_ms=5000, holder="b")
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert a.is_leader and not b.is_leader
    assert a.holder() == a.token
    assert a.renew() and not b.renew()
    assert a.try_acquire() and a.epoch == 1      # re-acquire by the holder renews; same tenure
    assert redis_client.pttl("t:leader") > 4000


def test_takeover_within_one_ttl_after_leader_stops_renewing(redis_client):
    ttl_ms = 300
    a = LeaderLease(redis_client, "t:leader", ttl_ms=ttl_ms)
    b = LeaderLease(redis_client, "t:leader", ttl_ms=ttl_ms)
    assert a.try_acquire()
    first_epoch = a.epoch
    stopped = time.monotonic()            # a stops renewing (crashed / paused)
    while not b.try_acquire():
        assert time.monotonic() - stopped < ttl_ms / 1000 + 0.2, "standby did not take over within one TTL"
        time.sleep(0.01)
    took = time.monotonic() - stopped
    assert took <= ttl_ms / 1000 + 0.15  # one TTL, plus polling slack on a busy machine
    assert b.epoch == first_epoch + 1
    assert a.renew() is False and not a.is_leader    # the old leader learns it lost
    assert a.try_acquire() is False


def test_release_hands_over_at_once_and_only_by_owner(redis_client):
    a = LeaderLease(redis_client, "t:leader", ttl_ms=60_000)
    b = LeaderLease(redis_client, "t:leader", ttl_ms=60_000)
    assert a.try_acquire()
    assert b.release() is False and a.holder() == a.token   # b cannot delete a's lease
    assert a.release() is True and not a.is_leader
    assert b.try_acquire() and b.epoch == 2


def test_is_leader_expires_locally_before_the_lease(redis_client):
    clock = Clock()
    a = LeaderLease(redis_client, "t:leader", ttl_ms=1000, clock=clock, safety_ms=200)
    assert a.try_acquire()
    clock.t = 0.79
    assert a.is_leader
    clock.t = 0.81                       # ttl - safety passed without a renewal
    assert not a.is_leader
    assert a.renew() and a.is_leader     # still ours in Redis: renewal restores it
    clock.t = 1.6
    assert a.is_leader


def test_concurrent_acquirers_only_one_wins_per_epoch(redis_client):
    leases = [LeaderLease(redis_client, "t:race", ttl_ms=10_000) for _ in range(8)]
    barrier = threading.Barrier(len(leases))
    results: list[bool] = [False] * len(leases)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = leases[i].try_acquire()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sum(results) == 1
    assert int(redis_client.get("t:race:epoch")) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="ttl_ms"):
        LeaderLease(None, ttl_ms=0)
    with pytest.raises(ValueError, match="safety_ms"):
        LeaderLease(None, ttl_ms=100, safety_ms=100)
