"""The ops demo end to end on the bundled models: adaptation happens and the bad canary is rolled back."""

from __future__ import annotations

from specops.decoder import Decoder
from specops.demo_ops import run_ops_demo


def test_ops_demo_rolls_back_the_bad_canary(tmp_path):
    dec = Decoder.from_pretrained("bundled")
    events: list[str] = []
    reports = run_ops_demo(dec, state_dir=tmp_path, rounds=8, canary_round=3,
                           on_event=events.append)
    assert len(reports) == 8
    assert events and "demo-bad-canary.yaml" in events[0]
    kinds = [d["kind"] for r in reports for d in r.decisions]
    assert "rollout.analysis" in kinds
    assert "rollout.rollback" in kinds, kinds  # the n-gram canary is slower than plain on hot prompts
    # Every class served traffic each round; canary traffic ran the canary's method. The creative
    # prose at temperature 1.0 is the default policy's `sampled` class; the bad canary has no such
    # class, so its share of that traffic lands in `general`, where it runs n-gram lookup.
    assert all(set(r.served) == {"code", "factual", "sampled"} for r in reports[:3])
    for r in reports[3:]:
        assert {"code", "factual"} <= set(r.served) <= {"code", "factual", "sampled", "general"}, r.served
        assert r.served.keys() & {"sampled", "general"}, r.served
    assert any("ngram" in m for r in reports[3:] for m in r.served.get("general", {}).get("methods", ()))
    # After the rollback the stable revision serves everything again.
    assert "degraded" in reports[-1].rollout
    # Adaptation happened: from the measured traffic the controller changed a class's knob
    # (γ / heads by the goodput model or the bandit, or speculation off by an alert), and
    # the effective settings after that tick are the decision's.
    changes = [(r, d) for r in reports for d in r.decisions if d["kind"] in ("adapt", "fallback_on")]
    assert changes, kinds
    applied = 0
    for r, d in changes:
        assert any(d["after"][k] != d["before"][k] for k in d["after"]), d
        s = r.settings[d["class"]]
        applied += (s["gamma"], s["heads"], s["fallback"]) == (
            d["after"]["gamma"], d["after"]["medusa_heads"], d["after"]["fallback_active"])
    assert applied > 0, changes


def test_ops_demo_over_http_closes_the_loop(tmp_path):
    """`specops serve` and `specops controller run` as processes: the server follows the rollout
    state in Redis, the controller acts on the telemetry the server published, no request fails."""
    from specops.demo_ops import run_ops_demo_http

    events: list[str] = []
    reports = run_ops_demo_http(state_dir=tmp_path, rounds=4, canary_round=2, per_kind=2, max_new_tokens=16,
                                on_event=events.append)
    assert len(reports) == 4 and all(r.errors == 0 for r in reports)
    assert all(set(r.served) == {"code", "factual", "sampled"} for r in reports[:2])  # see the test above
    for r in reports[2:]:
        assert {"code", "factual"} <= set(r.served) <= {"code", "factual", "sampled", "general"}, r.served
        assert r.served.keys() & {"sampled", "general"}, r.served
    assert all(row["canary"] == 0 for r in reports[:2] for row in r.served.values())
    assert sum(row["canary"] for row in reports[2].served.values()) > 0  # 50% of routing keys on revision 2
    general = [m for r in reports[2:] for m in r.served.get("general", {}).get("canary_methods", ())]
    assert not general or set(general) <= {"ngram", "ar"}  # the canary policy's method for hot prompts
    controller = [e for r in reports for e in r.events]
    assert any(e["kind"] in ("effective.set", "rollout.analysis") for e in controller), controller
    assert any("demo-bad-canary.yaml" in e for e in events)
