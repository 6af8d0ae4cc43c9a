"""PolicyRuntime: live settings from a real Redis drive the decoder; telemetry goes back to Redis."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specops.decoder import Decoder
from specops.serving.live_policy import LivePolicy
from specops.serving.policy_runtime import REASON_FALLBACK, REASON_OFF, REASON_TEMPERATURE, PolicyRuntime
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
