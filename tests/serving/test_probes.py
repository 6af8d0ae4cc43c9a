"""Probes: the share of a fallen-back class that keeps speculating, and the loop they close.

1. `PolicyRuntime` honours an intermediate ``probe_fraction`` (binomial test, ALPHA = 1e-3,
   fixed seeds; the same count rejects fractions of 0.15 and 0.5).
2. Runtime → Redis → controller → Redis → runtime, with no traffic written by the test: a
   draft model that is too slow makes the controller fall back from the runtime's own
   telemetry; once the draft is cheap again, the runtime's probes show it and the
   controller turns speculation back on. Decode time runs on a fake clock
   (`tests.decoder.clocked`: 1 s per target forward, the draft's cost set per phase) and
   the control loop on another (`tests.controller.helpers.FakeClock`), so every window is
   deterministic.
"""

from __future__ import annotations

import random
from dataclasses import replace

from prometheus_client import CollectorRegistry
from scipy.stats import binomtest

from specops.controller.controller import Controller
from specops.controller.sources import RedisWindowSource
from specops.decoder import Decoder
from specops.models.loading import load_runner
from specops.policies import load_policy
from specops.policies import rollout as machine
from specops.policies.store import PolicyStore
from specops.policies.live import LivePolicy
from specops.engine.policy_runtime import REASON_FALLBACK, PolicyRuntime
from specops.telemetry.redis_metrics import RedisPublisher, RedisWindowReader
from tests.controller.helpers import FakeClock as WallClock
from tests.decoder.clocked import ClockedRunner, FakeClock
from tests.decoder.tiny_models import perturbed, tiny_llama

ALPHA = 1e-3
PROMPT = [5, 17, 33, 2, 9, 41, 7]

POLICY = """
version: "p1"
default_class: code
classes:
  - name: code
    method: draft
    gamma: {initial: 3, min: 2, max: 8}
    adaptation: {mode: fixed, probe_fraction: PROBE}
alerts:
  - {name: slower, metric: speedup, op: "<", threshold: 1.0, for_s: 20, min_samples: 50, action: fallback}
"""


def _runtime(decoder, store, rng_seed: int, wall=None, reconcile_s: float = 0.001):
    live = LivePolicy(store, reconcile_s=reconcile_s)
    pub = RedisPublisher(store.redis, pod="pod-a", clock=wall) if wall is not None else None
    return PolicyRuntime(decoder, store=store, live=live, publisher=pub, rng=random.Random(rng_seed)), live


def test_intermediate_probe_fraction_is_honoured(redis_client):
    target = tiny_llama(seed=3)
    decoder = Decoder(target, draft=perturbed(target, 0.05))
    text = POLICY.replace("PROBE", "0.3")
    store = PolicyStore(redis_client)
    machine.start_rollout(store, load_policy(text), text)
    eff = store.effective()["code"]
    store.set_effective({"code": replace(eff, fallback_active=True, probe_fraction=0.3)}, epoch=None, reason="t")
    rt, watcher = _runtime(decoder, store, rng_seed=11, reconcile_s=3600.0)  # settings fixed from here on
    n = 240
    try:
        served = [rt.serve(PROMPT, max_new_tokens=1, routing_key=f"req-{i}") for i in range(n)]
    finally:
        watcher.close()
    probes = [s for s in served if s.probe]
    plain = [s for s in served if not s.probe]
    assert all(s.method == "draft" and s.fallback_reason is None for s in probes)
    assert all(s.method == "ar" and s.fallback_reason == REASON_FALLBACK for s in plain)
    k = len(probes)
    assert binomtest(k, n, 0.3).pvalue > ALPHA, k
    assert binomtest(k, n, 0.15).pvalue < ALPHA and binomtest(k, n, 0.5).pvalue < ALPHA, k  # power


def test_controller_falls_back_and_recovers_from_the_runtimes_own_probes(monkeypatch, redis_client):
    perf = FakeClock()
    perf.install(monkeypatch)
    wall = WallClock()
    target = tiny_llama(seed=3)
    draft = ClockedRunner(load_runner(perturbed(target, 0.05)), perf, forward_s=2.0)  # slower than the target
    decoder = Decoder(ClockedRunner(load_runner(target), perf, forward_s=1.0), draft=draft)
    text = POLICY.replace("PROBE", "0.5")
    store = PolicyStore(redis_client, clock=wall)
    machine.start_rollout(store, load_policy(text), text)
    ctl = Controller(store, RedisWindowSource(RedisWindowReader(redis_client, clock=wall)), clock=wall,
                     registry=CollectorRegistry(), window_s=10)
    rt, watcher = _runtime(decoder, store, rng_seed=5, wall=wall)

    def bucket(index: int) -> tuple[list, list[str]]:
        wall.now = (wall.now // 10 + 1) * 10 + 1
        served = [rt.serve(PROMPT, max_new_tokens=12, routing_key=f"b{index}-{i}") for i in range(12)]
        wall.now += 8.9
        return served, [d.kind for d in ctl.tick() if d.request_class == "code"]

    try:
        kinds = []
        for i in range(5):  # phase 1: every request speculates, and speculation is slower than plain
            served, k = bucket(i)
            kinds.append(k)
            if "fallback_on" in k:
                break
        assert any("fallback_on" in k for k in kinds), kinds
        assert all(s.method == "draft" and not s.probe for s in served)  # the bucket that tripped it
        eff = store.effective()["code"]
        assert eff.fallback_active and eff.gamma == 2 and eff.probe_fraction == 0.5

        served, k = bucket(10)  # fallen back: the runtime sends a share of probes, slow ones
        probes = [s for s in served if s.probe]
        assert probes and len(probes) < len(served) and "fallback_off" not in k
        assert all(s.method == "ar" for s in served if not s.probe)

        draft.forward_s = 0.05  # the draft got cheap: probes now pay
        recovered = None
        for i in range(11, 17):
            served, k = bucket(i)
            if "fallback_off" in k:
                recovered = i
                break
            assert any(s.probe for s in served)
        assert recovered is not None, "probes that pay never turned speculation back on"
        assert not store.effective()["code"].fallback_active
        served, _ = bucket(20)
        assert all(s.method == "draft" and not s.probe and s.fallback_reason is None for s in served)
    finally:
        watcher.close()
