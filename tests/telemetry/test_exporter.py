import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specops.telemetry import contract
from specops.telemetry.exporter import PrometheusExporter
from tests.telemetry.helpers import make_record

NAME_RE = re.compile(r"^specops_[a-z0-9_]+$")


def _samples(registry):
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}, text


class _SortedLookup(dict):
    """Look samples up by (name, labels) with the labels in any order."""

    def __getitem__(self, key):
        name, labels = key
        return super().__getitem__((name, tuple(sorted(labels))))


def test_contract_names_follow_prometheus_rules():
    names = [m.name for m in contract.METRICS]
    assert len(names) == len(set(names))
    for m in contract.METRICS:
        assert NAME_RE.match(m.name), m.name
        assert m.labels[:2] == ("class", "method")
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if "seconds" in m.name or m.kind == "histogram":
            assert "_seconds" in m.name  # base unit
        assert "milli" not in m.name and "ms" not in m.name.split("_")


def test_exporter_output_follows_the_contract():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry)
    exporter.observe(make_record("code"))
    exporter.observe(make_record("code", drafted=8, accepted=2, accepted_per_pos=[2, 0, 0, 0],
                                 fallback_reason="deadline", token_latencies_s=[0.003, 2.0], planned=True))
    exporter.observe(make_record("chat", method="medusa", gamma=0, heads=2, drafted=10, accepted=6,
                                 accepted_per_pos=[4, 2], head_predictions=[10, 10], head_correct=[7, 3]))
    raw, text = _samples(registry)
    samples = {(name, tuple(sorted(labels))): v for (name, labels), v in raw.items()}
    samples = _SortedLookup(samples)

    code = (("class", "code"), ("method", "draft"))
    assert samples[("specops_drafted_tokens_total", code)] == 24
    assert samples[("specops_accepted_tokens_total", code)] == 14
    assert samples[("specops_generated_tokens_total", code)] == 40
    assert samples[("specops_requests_total", code)] == 2
    assert samples[("specops_decode_seconds_total", code)] == pytest.approx(0.8)
    assert samples[("specops_plain_decode_seconds_estimate_total", code)] == pytest.approx(1.2)
    assert samples[("specops_accepted_tokens_by_position_total", code + (("position", "0"),))] == 6
    assert samples[("specops_fallbacks_total", code + (("reason", "deadline"),))] == 1
    assert samples[("specops_planned_requests_total", code)] == 1
    assert samples[("specops_gamma", code)] == 4
    assert samples[("specops_token_latency_seconds_count", code)] == 22
    assert samples[("specops_token_latency_seconds_bucket", code + (("le", "0.005"),))] == 1
    assert samples[("specops_token_latency_seconds_bucket", code + (("le", "+Inf"),))] == 22

    chat = (("class", "chat"), ("method", "medusa"))
    assert samples[("specops_medusa_head_correct_total", tuple(sorted(chat + (("head", "1"),))))] == 3
    assert samples[("specops_medusa_heads", chat)] == 2

    # Every family the contract names is exported, and nothing else under the prefix.
    families = {f.name for f in text_string_to_metric_families(text)}
    expected = {m.name[: -len("_total")] if m.kind == "counter" else m.name for m in contract.METRICS}
    # (prometheus_client adds *_created timestamps, which the text parser reports as families)
    assert {f for f in families if f.startswith("specops_") and not f.endswith("_created")} == expected


def test_promql_references_only_contract_series():
    known = {m.name for m in contract.METRICS} | {contract.TOKEN_LATENCY.name + "_bucket"}
    for name in contract.PROMQL:
        expr = contract.promql(name, "2m", 'class="x"')
        used = set(re.findall(r"specops_[a-z0-9_]+", expr))
        assert used and used <= known, (name, used - known)
        gauge_only = name in ("gamma", "medusa_heads")
        assert ("[2m]" in expr) != gauge_only and 'class="x"' in expr and "$" not in expr


def test_promql_rejects_unknown_names_and_bad_windows():
    with pytest.raises(KeyError, match="unknown derived series"):
        contract.promql("accept_rate")
    with pytest.raises(ValueError, match="window"):
        contract.promql("speedup", window="five minutes")
    assert contract.class_matcher('a"b') == 'class="a\\"b"'


def test_docs_mirror_the_contract():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
    for m in contract.METRICS:
        assert f"`{m.name}`" in doc, m.name
    for name in contract.PROMQL:
        assert f"| `{name}` | `{contract.promql(name, '5m')}` |" in doc, name
