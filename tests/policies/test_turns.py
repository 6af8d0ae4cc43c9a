"""Conversation turn as a class attribute: schema errors with FILE:LINE, classification, bounded labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from specops.policies import PolicyError, load_policy
from specops.policies.turns import resolve_turn, turn_bucket, turn_from_labels, turn_from_messages
from specops.telemetry.records import DecodeRecord
from specops.telemetry.turn_metrics import TurnExporter

POLICY = """\
version: "t1"
default_class: chat
classes:
  - name: first
    match:
      - turn:
          min: 1
          max: 1
  - name: followup
    match:
      - turn:
          min: 2
        label:
          app: chat
  - name: chat
telemetry:
  turn_label: true
"""


def _bad(old: str, new: str) -> tuple[str, int]:
    lines = POLICY.splitlines()
    hits = [i for i, ln in enumerate(lines) if ln == old]
    assert len(hits) == 1
    lines[hits[0]] = new
    return "\n".join(lines) + "\n", hits[0] + 1


@pytest.mark.parametrize("old,new,path,fragment,line_of", [
    ("          min: 1", "          min: 0", "classes[0].match[0].turn.min", "greater than or equal to 1", None),
    ("          max: 1", "          max: x", "classes[0].match[0].turn.max", "valid integer", None),
    ("          min: 2", "          min: 1.5", "classes[1].match[0].turn.min", "valid integer", None),
    ("          max: 1", "          max: 0", "classes[0].match[0].turn.max", "greater than or equal to 1", None),
    ("          min: 1", "          min: 3", "classes[0].match[0].turn", "min (3) must be <= max (1)", "      - turn:"),
    ("          min: 1", "          mn: 1", "classes[0].match[0].turn.mn", "unknown field", None),
    ("  turn_label: true", "  turn_label: maybe", "telemetry.turn_label", "valid boolean", None),
    ("  turn_label: true", "  turn_labels: true", "telemetry.turn_labels", "unknown field", None),
])
def test_bad_turn_field_reports_file_line_and_path(old, new, path, fragment, line_of):
    text, line = _bad(old, new)
    with pytest.raises(PolicyError) as info:
        load_policy(text, filename="chat.yaml")
    wanted = [e for e in info.value.errors if e.path == path]
    assert wanted, [str(e) for e in info.value.errors]
    if line_of is not None:  # cross-field error: points at the object's key
        line = text.splitlines().index(line_of) + 1
    assert fragment in wanted[0].message
    assert str(wanted[0]).startswith(f"chat.yaml:{line}: {path}: ")


def test_turn_alone_is_a_condition_and_empty_rule_names_it():
    with pytest.raises(PolicyError) as info:
        load_policy("version: v\ndefault_class: a\nclasses:\n  - name: a\n    match:\n      - {}\n", filename="p.yaml")
    assert "turn" in str(info.value)


def test_classify_by_turn_messages_and_label_fallback():
    p = load_policy(POLICY)
    assert p.classify("hi", {}, 3, turn=1).name == "first"
    assert p.classify("hi", {"app": "chat"}, 3, turn=2).name == "followup"
    assert p.classify("hi", {}, 3, turn=7).name == "chat"            # followup also needs the label
    assert p.classify("hi", {"app": "chat"}, 3, turn=30).name == "followup"  # no max: unbounded
    assert p.classify("hi", {}, 3).name == "chat"                    # unknown turn never matches
    # completions: the `turn` label carries it; an explicit turn wins over the label
    assert p.classify("hi", {"turn": "1"}, 3).name == "first"
    assert p.classify("hi", {"turn": "2", "app": "chat"}, 3).name == "followup"
    assert p.classify("hi", {"turn": "1", "app": "chat"}, 3, turn=2).name == "followup"
    for junk in ("0", "-1", "x", "1.0", "", "٣", "1" * 20):
        assert p.classify("hi", {"turn": junk}, 3).name == "chat", junk
    with pytest.raises(ValueError, match="turn must be an integer >= 1"):
        p.classify("hi", {}, 3, turn=0)


def test_turn_from_messages_counts_assistant_messages():
    assert turn_from_messages([{"role": "user", "content": "q"}]) == 1
    assert turn_from_messages([]) == 1
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    assert turn_from_messages(conv) == 3
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        turn_from_messages([{"role": "user"}, "assistant"])
    assert turn_from_labels({"turn": "04"}) == 4 and turn_from_labels(None) is None
    assert resolve_turn(None, {"turn": "2"}) == 2 and resolve_turn(5, {"turn": "2"}) == 5


def test_turn_label_is_bounded():
    assert [turn_bucket(t) for t in (1, 2, 3, 4, 1000)] == ["1", "2", "3+", "3+", "3+"]
    assert turn_bucket(None) is None
    registry = CollectorRegistry()
    exporter = TurnExporter(registry)
    record = DecodeRecord(request_class="first", method="draft", new_tokens=10, drafted=8, accepted=6,
                          accepted_per_pos=[3, 3], target_forwards=4, draft_s=0.1, verify_s=0.2, wall_s=0.3,
                          plain_s_estimate=0.5, token_latencies_s=[0.03] * 10, head_predictions=[], head_correct=[],
                          gamma=2, heads=0)
    for turn in range(1, 50):
        exporter.observe(record, turn)
    assert exporter.observe(record, None) is None
    turns = {s.labels["turn"] for m in registry.collect() for s in m.samples if "turn" in s.labels}
    assert turns == {"1", "2", "3+"}
    assert registry.get_sample_value("specops_turn_accepted_tokens_total",
                                     {"class": "first", "method": "draft", "turn": "3+"}) == 6 * 47


def test_example_chat_policy_has_first_and_followup_classes():
    p = load_policy("examples/policies/chat.yaml")
    assert p.telemetry.turn_label
    assert p.classify("hello there", {}, 5, turn=1).name == "chat-first"
    assert p.classify("hello there", {}, 5, turn=2).name == "chat-followup"
    assert p.classify("hello there", {}, 5).name == "chat"
    assert p.get_class("chat-first").gamma.initial > p.get_class("chat-followup").gamma.initial
    assert all(p.get_class(n).adaptation.mode != "fixed" for n in ("chat-first", "chat-followup"))
