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


def test_the_policies_are_retargeted_to_the_methods_a_served_model_has():
    """`specops demo --model`: classes whose method needs a draft model or Medusa heads the model
    lacks run eagle where it has a drafter and the class is sampled or on Medusa heads, else n-gram
    lookup; the rest stays as written."""
    from specops.demo_ops import BAD_CANARY_POLICY, DEFAULT_POLICY, fast_policy_text
    from specops.policies.loader import parse_policy
    from specops.policies.retarget import retarget_policy, sampled

    for path in (DEFAULT_POLICY, BAD_CANARY_POLICY):
        text = fast_policy_text(path, 0.25)
        before = {c.name: c for c in parse_policy(text, path.name).classes}
        for methods in (["ngram"], ["ngram", "eagle"]):
            out, chosen = retarget_policy(text, methods)
            after = {c.name: c for c in parse_policy(out, path.name).classes}
            assert list(after) == list(before) and chosen == {n: c.method for n, c in after.items()}
            for name, cls in after.items():
                old = before[name]
                if old.method in ("draft", "medusa"):
                    to_eagle = "eagle" in methods and (old.method == "medusa" or sampled(old))
                    expected = "eagle" if to_eagle else "ngram"
                else:
                    expected = old.method
                assert cls.method == expected, (path.name, name)
                assert cls.match == old.match and cls.temperature == old.temperature
                if old.method != "medusa":
                    assert cls.gamma == old.gamma
        assert "eagle" in retarget_policy(text, ["ngram", "eagle"])[1].values()
    assert retarget_policy(fast_policy_text(DEFAULT_POLICY, 0.25), ["draft", "medusa", "ngram"])[0] == \
        fast_policy_text(DEFAULT_POLICY, 0.25)


def test_chat_traffic_lands_in_the_default_policys_classes():
    """The chat model's ops traffic: the user messages classify as code, factual and sampled."""
    from specops.demo_ops import DEFAULT_POLICY, chat_demo_traffic
    from specops.policies import load_policy

    policy = load_policy(DEFAULT_POLICY)
    classes = {s.name: {policy.classify(p, s.labels, 40, 1, s.temperature).name for p in s.prompts}
               for s in chat_demo_traffic(per_kind=3)}
    assert classes == {"code": {"code"}, "factual": {"factual"}, "creative": {"sampled"}}


def test_ops_demo_over_http_serves_the_given_model_with_chat_requests(tmp_path):
    """`specops demo --model PATH`'s ops part: `specops serve --model PATH` (requests name the
    folder's model, which a server of the bundled models would refuse), chat requests, and the
    policies' draft / Medusa classes on n-gram lookup, the method a lone target has."""
    from specops.assets import TARGET_DIR
    from specops.demo_ops import run_ops_demo_http

    reports = run_ops_demo_http(state_dir=tmp_path, rounds=2, canary_round=1, per_kind=1, max_new_tokens=8,
                                model=str(TARGET_DIR), chat=True, methods=["ngram"])
    assert len(reports) == 2 and all(r.errors == 0 for r in reports)
    assert set(reports[0].served) == {"code", "factual", "sampled"}
    methods = {m for r in reports for row in r.served.values() for m in row["methods"]}
    assert methods and methods <= {"ngram", "ngram(probe)", "ar"}, methods
    assert "ngram" in methods
    assert all(s["method"] in ("ngram", "off") for r in reports for s in r.settings.values())
