"""PolicyRuntime: live settings from a real Redis drive the decoder; telemetry goes back to Redis."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.policies.live import LivePolicy
from specops.engine.policy_runtime import REASON_FALLBACK, REASON_OFF, REASON_TEMPERATURE, PolicyRuntime
from specops.policies import load_policy
from specops.policies import rollout as machine
from specops.policies.store import PolicyStore
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader
from tests.decoder.tiny_models import perturbed, tiny_llama

POLICY = """
version: "t1"
description: runtime test
default_class: general
classes:
  - name: code
    match: [{label: {task: code}}]
    method: draft
    gamma: {initial: 3, min: 1, max: 8}
    temperature: {min: 0.0, max: 0.5}
    adaptation: {mode: fixed, probe_fraction: 0.0}
  - name: general
    method: "off"
alerts: []
rollout:
  steps: [{weight: 50, pause_s: 60}, {weight: 100, pause_s: 0}]
"""

CANARY = POLICY.replace('version: "t1"', 'version: "t2"').replace("initial: 3", "initial: 5")


@pytest.fixture(scope="module")
def decoder():
    target = tiny_llama(seed=3)
    return Decoder(target, draft=perturbed(target, 0.05))


@pytest.fixture
def runtime(decoder, redis_client):
    store = PolicyStore(redis_client, namespace="rt")
    machine.start_rollout(store, load_policy(POLICY), POLICY)
    live = LivePolicy(store, reconcile_s=0.001)
    pub = RedisPublisher(redis_client, pod="pod-a", namespace="rt")
    canary_pub = RedisPublisher(redis_client, pod="pod-a", namespace="rt:canary")
    rt = PolicyRuntime(decoder, store=store, live=live, publisher=pub, canary_publisher=canary_pub,
                       rng=random.Random(1))
    yield rt
    rt.close()


PROMPT = [5, 17, 33, 2, 9, 41, 7]


def test_live_gamma_and_telemetry(runtime, redis_client):
    served = runtime.serve(PROMPT, labels={"task": "code"}, max_new_tokens=20, routing_key="k")
    assert served.request_class == "code" and served.method == "draft" and not served.canary
    assert served.stats.gamma_trace[0] == 3 and max(served.stats.gamma_trace) == 3
    # The controller changes γ: the runtime picks it up through the watcher.
    store = runtime.store
    eff = store.effective()["code"]
    store.set_effective({"code": replace(eff, gamma=6)}, epoch=None, reason="test")
    served = runtime.serve(PROMPT, labels={"task": "code"}, max_new_tokens=20, routing_key="k")
    assert max(served.stats.gamma_trace) == 6
    window = RedisWindowReader(redis_client, namespace="rt").window("code", 60)
    assert window.requests == 2
    assert window.new_tokens == 40
    assert window.accepted == sum(window.accepted_per_pos) and window.drafted >= window.accepted > 0
    assert window.speedup is not None and window.speedup > 0


def test_off_fallback_probe_and_temperature(runtime, decoder):
    plain = decoder.generate(PROMPT, method="ar", max_new_tokens=12).tokens
    served = runtime.serve(PROMPT, labels={}, max_new_tokens=12, routing_key="k")
    assert served.request_class == "general" and served.method == "ar" and served.fallback_reason == REASON_OFF
    assert served.tokens == plain
    served = runtime.serve(PROMPT, labels={"task": "code"}, temperature=0.9, max_new_tokens=12, routing_key="k", seed=0)
    assert served.method == "ar" and served.fallback_reason == REASON_TEMPERATURE
    store = runtime.store
    eff = store.effective()["code"]
    store.set_effective({"code": replace(eff, fallback_active=True, probe_fraction=0.0)}, epoch=None, reason="t")
    served = runtime.serve(PROMPT, labels={"task": "code"}, max_new_tokens=12, routing_key="k")
    assert served.method == "ar" and served.fallback_reason == REASON_FALLBACK and served.tokens == plain
    store.set_effective({"code": replace(eff, fallback_active=True, probe_fraction=1.0)}, epoch=None, reason="t")
    served = runtime.serve(PROMPT, labels={"task": "code"}, max_new_tokens=12, routing_key="k")
    assert served.probe and served.method == "draft" and served.tokens == plain  # greedy: still exact


def test_canary_traffic_uses_canary_policy_and_namespace(runtime, redis_client):
    machine.start_rollout(runtime.store, load_policy(CANARY), CANARY)  # step 0: 50% on the canary
    served = [runtime.serve(PROMPT, labels={"task": "code"}, max_new_tokens=8, routing_key=f"req-{i}")
              for i in range(40)]
    canary = [s for s in served if s.canary]
    stable = [s for s in served if not s.canary]
    assert 8 <= len(canary) <= 32 and stable  # a stable hash splits ~50/50
    assert all(s.stats.gamma_trace[0] == 5 for s in canary)
    assert all(s.stats.gamma_trace[0] == 3 for s in stable)
    assert RedisWindowReader(redis_client, namespace="rt:canary").window("code", 60).requests == len(canary)
    assert RedisWindowReader(redis_client, namespace="rt").window("code", 60).requests == len(stable)


DEADLINE_POLICY = """
version: "d1"
description: a class with a decode deadline
default_class: general
classes:
  - name: code
    match: [{label: {task: code}}]
    method: draft
    gamma: {initial: 3, min: 1, max: 8}
    deadline_s: 4.6
    adaptation: {mode: fixed, probe_fraction: 0.0}
  - name: general
    method: draft
    gamma: {initial: 3, min: 1, max: 8}
    adaptation: {mode: fixed, probe_fraction: 0.0}
alerts: []
"""


def test_class_deadline_ends_the_request_in_plain_decoding(monkeypatch, redis_client):
    """The policy's per-class ``deadline_s`` reaches the decoder: on a fake clock (1 s per
    target forward, 0.25 s per draft forward) a 24-token request outlives the code class's
    4.6 s, so it ends in plain steps with the same tokens and publishes the fallback; the
    class without a deadline speculates to the end."""
    from specops.models.loading import load_runner
    from tests.decoder.clocked import ClockedRunner, FakeClock
    from tests.decoder.test_deadline import check_tail_is_plain

    clock = FakeClock()
    clock.install(monkeypatch)
    target = tiny_llama(seed=3)
    runner = ClockedRunner(load_runner(target), clock)
    dec = Decoder(runner, draft=ClockedRunner(load_runner(perturbed(target, 0.05)), clock, forward_s=0.25))
    plain = dec.generate(PROMPT, method="ar", max_new_tokens=24).tokens
    pub = RedisPublisher(redis_client, pod="pod-a", namespace="dl")
    rt = PolicyRuntime(dec, load_policy(DEADLINE_POLICY), publisher=pub, rng=random.Random(1))

    start = len(runner.log)
    served = rt.serve(PROMPT, labels={"task": "code"}, max_new_tokens=24)
    assert served.request_class == "code" and served.method == "draft"
    assert served.fallback_reason == "deadline" and served.tokens == plain
    check_tail_is_plain(runner.log[start:], 4.6)

    start = len(runner.log)
    general = rt.serve(PROMPT, labels={}, max_new_tokens=24)
    assert general.request_class == "general" and general.fallback_reason is None and general.tokens == plain
    assert runner.log[-1].start - runner.log[start].start > 4.6  # as long, yet it speculated throughout
    assert all(f.width > 1 for f in runner.log[start + 1 : -1]) and general.stats.gamma_trace.count(0) <= 1

    reader = RedisWindowReader(redis_client, namespace="dl")
    assert reader.window("code", 60).fallbacks == {"deadline": 1}
    assert reader.window("general", 60).fallbacks == {}


# -- fail-static: a real Redis stopped, restarted empty, flushed ------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def own_redis(tmp_path):
    from tests.services import start_redis

    svc = start_redis(tmp_path / "redis")
    yield svc
    svc.stop()


def _restart_on_same_port(svc, workdir):
    from tests.services import redis_server_binary, start_service

    argv = [redis_server_binary(), "--port", str(svc.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]
    return start_service("redis2", argv, svc.port, workdir)


def test_live_policy_is_fail_static_with_backoff(own_redis, tmp_path):
    import time

    import redis

    from specops.policies.live import STALE_EMPTY, STALE_UNREACHABLE, serving_redis

    admin = PolicyStore(redis.Redis(port=own_redis.port), namespace="fs")
    machine.start_rollout(admin, load_policy(POLICY), POLICY)
    eff = admin.effective()["code"]
    admin.set_effective({"code": replace(eff, gamma=7)}, epoch=None, reason="t")
    clock = FakeClock()
    store = PolicyStore(serving_redis(f"redis://127.0.0.1:{own_redis.port}/0"), namespace="fs")
    live = LivePolicy(store, reconcile_s=1.0, clock=clock, backoff_s=(2.0, 4.0))
    parts = SimpleNamespace(draft=object(), medusa=None)  # a decoder with a draft model loaded
    rt = PolicyRuntime(parts, live=live, rng=random.Random(0))
    assert not live.stale and live.settings_for("code").gamma == 7

    own_redis.stop()
    clock.now += 1.5  # reconcile due
    started = time.monotonic()
    assert live.poll() is False
    assert time.monotonic() - started < 1.5  # one attempt, no redis-py retry loop
    assert live.stale_reason == STALE_UNREACHABLE and live.failures == 1
    res = rt.resolve("x", 3, labels={"task": "code"}, temperature=0.0)
    assert res.request_class == "code" and res.method == "draft" and res.gamma == 7 and res.revision == 1
    clock.now += 1.0  # inside the 2 s backoff: no attempt at all
    assert live.poll() is False and live.failures == 1
    clock.now += 1.5
    live.poll()
    assert live.failures == 2  # the next attempt waits 4 s
    clock.now += 3.0
    live.poll()
    assert live.failures == 2

    restarted = _restart_on_same_port(own_redis, tmp_path / "redis2")  # restarted without its data
    try:
        clock.now += 5.0
        assert live.poll() is False
        assert live.stale_reason == STALE_EMPTY and live.settings_for("code").gamma == 7
        assert rt.resolve("x", 3, labels={"task": "code"}).gamma == 7
        admin2 = PolicyStore(redis.Redis(port=own_redis.port), namespace="fs")
        machine.start_rollout(admin2, load_policy(CANARY), CANARY)  # re-seeded (initial gamma 5)
        clock.now += 1.5
        assert live.poll() is True and not live.stale
        assert rt.resolve("x", 3, labels={"task": "code"}).gamma == 5
        admin2.redis.flushall()  # data loss again: keep the last good values
        clock.now += 1.5
        live.poll()
        assert live.stale_reason == STALE_EMPTY and live.settings_for("code").gamma == 5
        assert live.status()["live"] is False and live.status()["stale_reason"] == STALE_EMPTY
    finally:
        live.close()
        restarted.stop()


def test_record_buffer_keeps_records_through_an_outage(own_redis, tmp_path):
    from specops.policies.live import serving_redis
    from specops.telemetry.record_buffer import RecordBuffer
    from specops.telemetry import DecodeRecord

    def rec(n: int) -> DecodeRecord:
        return DecodeRecord(request_class="code", method="draft", new_tokens=n, drafted=4, accepted=2,
                            accepted_per_pos=[1, 1], target_forwards=2, draft_s=0.01, verify_s=0.05, wall_s=0.1,
                            plain_s_estimate=0.2, token_latencies_s=[0.05] * n, head_predictions=[], head_correct=[],
                            gamma=4, heads=0)

    client = serving_redis(f"redis://127.0.0.1:{own_redis.port}/0")
    clock = FakeClock()
    buf = RecordBuffer(RedisPublisher(client, pod="p", namespace="rb"), max_records=5, clock=clock, backoff_s=(1.0,))
    buf.add(rec(1))
    assert buf.flush() == 1
    own_redis.stop()
    for n in range(2, 9):  # 7 records into a buffer of 5: the 2 oldest are dropped and counted
        buf.add(rec(n))
    assert buf.flush() == 0 and len(buf) == 5 and buf.dropped == 2
    restarted = _restart_on_same_port(own_redis, tmp_path / "redis2")
    try:
        assert buf.flush() == 0  # still backing off
        clock.now += 1.0
        assert buf.flush() == 5 and len(buf) == 0
        window = RedisWindowReader(client, namespace="rb").window("code", 60)
        assert window.requests == 5 and window.new_tokens == sum(range(4, 9))
    finally:
        restarted.stop()



def test_record_buffer_flushes_in_batches_one_transaction_each(redis_client):
    """A backlog goes out `FLUSH_BATCH` records per MULTI/EXEC, canary records through their own
    publisher, in queue order; a window counts every record once."""
    from specops.telemetry.record_buffer import FLUSH_BATCH, RecordBuffer
    from specops.telemetry.records import DecodeRecord
    from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader

    executed = []

    class Counting:
        """The real client, counting transactions."""

        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def pipeline(self, transaction=True):
            pipe = self.client.pipeline(transaction=transaction)

            class Pipe:
                def __getattr__(self, name):
                    return getattr(pipe, name)

                def execute(self):
                    executed.append(len(pipe.command_stack))
                    return pipe.execute()

            return Pipe()

    def rec(n: int) -> DecodeRecord:
        return DecodeRecord(request_class="code", method="draft", new_tokens=n, drafted=4, accepted=2,
                            accepted_per_pos=[1, 1], target_forwards=2, draft_s=0.01, verify_s=0.05, wall_s=0.1,
                            plain_s_estimate=0.2, token_latencies_s=[], head_predictions=[], head_correct=[],
                            gamma=4, heads=0)

    client = Counting(redis_client)
    buf = RecordBuffer(RedisPublisher(client, pod="p", namespace="bat"),
                       RedisPublisher(client, pod="p", namespace="bat-canary"))
    n = FLUSH_BATCH + 6
    for i in range(n):
        buf.add(rec(1))
    buf.add(rec(100), canary=True)
    buf.add(rec(1))
    assert buf.flush() == n + 2 and len(buf) == 0
    # FLUSH_BATCH, then the 6 left before the canary record, the canary record, the last one
    assert len(executed) == 4
    assert executed[0] == executed[1] == executed[3]  # one command per field, whatever the records
    stable = RedisWindowReader(redis_client, namespace="bat").window("code", 60)
    canary = RedisWindowReader(redis_client, namespace="bat-canary").window("code", 60)
    assert (stable.requests, stable.new_tokens, stable.drafted) == (n + 1, n + 1, 4 * (n + 1))
    assert (canary.requests, canary.new_tokens) == (1, 100)



def test_record_buffer_waits_its_interval_unless_a_batch_waits_or_forced(redis_client):
    """``min_interval_s``: records finished in quick succession go out together; a full batch,
    or a forced flush (a server stopping), does not wait."""
    from specops.telemetry.record_buffer import FLUSH_BATCH, RecordBuffer
    from specops.telemetry.records import DecodeRecord
    from specops.telemetry.redis_metrics import RedisPublisher

    rec = DecodeRecord(request_class="code", method="ar", new_tokens=3, drafted=0, accepted=0, accepted_per_pos=[],
                       target_forwards=3, draft_s=0.0, verify_s=0.05, wall_s=0.1, plain_s_estimate=0.1,
                       token_latencies_s=[], head_predictions=[], head_correct=[], gamma=0, heads=0)
    clock = FakeClock()
    buf = RecordBuffer(RedisPublisher(redis_client, pod="p", namespace="iv"), clock=clock, min_interval_s=1.0)
    buf.add(rec)
    assert buf.flush() == 1  # the first flush does not wait
    buf.add(rec)
    clock.now += 0.5
    assert buf.flush() == 0 and len(buf) == 1
    clock.now += 0.5
    assert buf.flush() == 1
    for _ in range(FLUSH_BATCH):
        buf.add(rec)
    assert buf.flush() == FLUSH_BATCH  # a full batch goes at once
    buf.add(rec)
    assert buf.flush() == 0 and buf.flush(force=True) == 1
    with pytest.raises(ValueError, match="min_interval_s"):
        RecordBuffer(min_interval_s=-1.0)


def test_record_buffer_does_not_count_twice_a_publish_applied_but_unanswered(redis_client):
    """Redis applies the transaction, then the reply is lost (Redis SIGKILLed before answering):
    the retry must see the record is there and not count it again (found by `specops chaos`)."""
    import redis as redis_mod

    from specops.telemetry.record_buffer import RecordBuffer
    from specops.telemetry.records import DecodeRecord
    from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader

    class LosesOneReply:
        """The real client, except that one transaction's reply is lost after Redis applied it."""

        def __init__(self, client):
            self.client, self.lose = client, 1

        def __getattr__(self, name):
            return getattr(self.client, name)

        def pipeline(self, transaction=True):
            pipe, outer = self.client.pipeline(transaction=transaction), self

            class Pipe:
                def __getattr__(self, name):
                    return getattr(pipe, name)

                def execute(self):
                    result = pipe.execute()
                    if outer.lose:
                        outer.lose -= 1
                        raise redis_mod.ConnectionError("Connection closed by server.")
                    return result

            return Pipe()

    def rec(n: int) -> DecodeRecord:
        return DecodeRecord(request_class="code", method="draft", new_tokens=n, drafted=4, accepted=2,
                            accepted_per_pos=[1, 1], target_forwards=2, draft_s=0.01, verify_s=0.05, wall_s=0.1,
                            plain_s_estimate=0.2, token_latencies_s=[0.05] * n, head_predictions=[], head_correct=[],
                            gamma=4, heads=0)

    buf = RecordBuffer(RedisPublisher(LosesOneReply(redis_client), pod="p", namespace="dup"), backoff_s=(0.0,))
    buf.add(rec(1))
    buf.add(rec(2))
    assert buf.flush() == 0 and len(buf) == 2  # the first publish "failed" (but was applied)
    assert buf.flush() == 2 and len(buf) == 0
    window = RedisWindowReader(redis_client, namespace="dup").window("code", 60)
    assert window.requests == 2 and window.new_tokens == 3


MEDUSA_POLICY = """
version: "m1"
default_class: general
classes:
  - name: code
    match: [{label: {task: code}}]
    method: medusa
    lookup_branch: 8
    typical: true
  - name: general
    method: medusa
"""


def test_medusa_classes_carry_their_lookup_branch_and_typical_acceptance_to_the_engine_and_the_decoder(monkeypatch):
    """A class's ``lookup_branch`` reaches every Medusa request (the engine's settings, the
    decoder's keyword); its LOSSY ``typical`` only a sampled one's, and the response says so."""
    from specops.spec.medusa_branch import LOOKUP_BRANCH
    from specops.policies.schema import LOOKUP_BRANCH as POLICY_DEFAULT
    from specops.engine.async_engine import AsyncEngine

    assert POLICY_DEFAULT == LOOKUP_BRANCH  # the policy layer's default is the decoder's
    target = tiny_llama(seed=3)
    dec = Decoder(target, medusa=MedusaHeads.from_model(target, 2))
    rt = PolicyRuntime(dec, load_policy(MEDUSA_POLICY), rng=random.Random(1))
    greedy = rt.resolve("x", 3, labels={"task": "code"}, temperature=0.0)
    sampled = rt.resolve("x", 3, labels={"task": "code"}, temperature=0.7)
    general = rt.resolve("x", 3, temperature=0.7)
    assert (greedy.spec.lookup_branch, greedy.typical, greedy.as_dict()["typical"]) == (8, False, False)
    assert (sampled.spec.lookup_branch, sampled.typical, sampled.as_dict()["typical"]) == (8, True, True)
    assert (general.spec.lookup_branch, general.typical) == (LOOKUP_BRANCH, False)
    client = AsyncEngine(SimpleNamespace(scheduler=SimpleNamespace(running=[])), runtime=None, tokenizer=[0] * 10,
                         metrics=None)
    spec = client.spec_for(sampled)
    spec.check()
    assert (spec.method, spec.lookup_branch, spec.typical) == ("medusa", 8, True)

    calls = []
    generate = Decoder.generate

    def recorded(self, prompt, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("method", "lookup_branch", "typical")})
        return generate(self, prompt, **kwargs)

    monkeypatch.setattr(Decoder, "generate", recorded)
    plain = generate(dec, PROMPT, method="ar", max_new_tokens=12).tokens
    served = rt.serve(PROMPT, labels={"task": "code"}, max_new_tokens=12)
    assert served.method == "medusa" and served.tokens == plain  # greedy: exact, typical or not
    rt.serve(PROMPT, labels={"task": "code"}, max_new_tokens=12, temperature=0.7, seed=0)
    assert calls == [{"method": "medusa", "lookup_branch": 8, "typical": False},
                     {"method": "medusa", "lookup_branch": 8, "typical": True}]
