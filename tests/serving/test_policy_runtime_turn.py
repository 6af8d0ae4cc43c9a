"""PolicyRuntime passes the conversation turn to classification and, when asked, to a bounded telemetry label."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from specops.decoder import Decoder
from specops.policies import load_policy
from specops.engine.policy_runtime import PolicyRuntime
from specops.telemetry.exporter import PrometheusExporter
from tests.decoder.tiny_models import perturbed, tiny_llama

POLICY = """
version: "turns"
default_class: other
classes:
  - name: first
    match: [{turn: {min: 1, max: 1}}]
    method: draft
    gamma: {initial: 4, min: 1, max: 8}
  - name: later
    match: [{turn: {min: 2}}]
    method: draft
    gamma: {initial: 1, min: 1, max: 8}
  - name: other
    method: "off"
telemetry: {turn_label: true}
"""

PROMPT = [5, 17, 33, 2, 9, 41, 7]


@pytest.fixture(scope="module")
def decoder():
    target = tiny_llama(seed=3)
    return Decoder(target, draft=perturbed(target, 0.05))


def test_turn_picks_class_and_gamma_and_label(decoder):
    registry = CollectorRegistry()
    rt = PolicyRuntime(decoder, load_policy(POLICY), exporter=PrometheusExporter(registry))
    first = rt.serve(PROMPT, turn=1, max_new_tokens=12)
    later = rt.serve(PROMPT, turn=5, max_new_tokens=12)
    by_label = rt.serve(PROMPT, labels={"turn": "2"}, max_new_tokens=12)
    unknown = rt.serve(PROMPT, max_new_tokens=12)
    assert (first.request_class, later.request_class, by_label.request_class, unknown.request_class) == \
        ("first", "later", "later", "other")
    assert first.stats.gamma == 4 and later.stats.gamma == 1 and unknown.method == "ar"
    assert first.tokens == later.tokens == unknown.tokens  # greedy: lossless whatever the class
    assert (first.turn_label, later.turn_label, by_label.turn_label, unknown.turn_label) == ("1", "3+", "2", None)
    assert registry.get_sample_value("specops_turn_requests_total",
                                     {"class": "later", "method": "draft", "turn": "3+"}) == 1
    assert registry.get_sample_value("specops_turn_requests_total",
                                     {"class": "later", "method": "draft", "turn": "2"}) == 1


def test_no_turn_series_unless_the_policy_asks(decoder):
    registry = CollectorRegistry()
    policy = load_policy(POLICY.replace("telemetry: {turn_label: true}", ""))
    rt = PolicyRuntime(decoder, policy, exporter=PrometheusExporter(registry))
    served = rt.serve(PROMPT, turn=1, max_new_tokens=8)
    assert served.request_class == "first" and served.turn == 1 and served.turn_label is None
    assert not [s for m in registry.collect() for s in m.samples if "turn" in s.labels]


def test_bad_turn_is_a_value_error(decoder):
    rt = PolicyRuntime(decoder, load_policy(POLICY))
    with pytest.raises(ValueError, match="turn must be an integer >= 1"):
        rt.serve(PROMPT, turn=0, max_new_tokens=4)
