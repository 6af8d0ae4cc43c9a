import pytest

from specops.alerts.webhook import (
    AlertAction,
    AlertDeferred,
    AlertRejected,
    WebhookError,
    WebhookReceiver,
    parse_payload,
    parse_time,
)
from tests.alerts.payloads import alert, alertmanager, grafana

TOKEN = "s3cret-token"
AUTH = f"Bearer {TOKEN}"


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def received():
    return []


@pytest.fixture
def receiver(received):
    return WebhookReceiver(TOKEN, received.append, clock=FakeClock())


@pytest.mark.parametrize("build, source", [(alertmanager, "alertmanager"), (grafana, "grafana")])
def test_both_formats_map_labels_to_actions(build, source, receiver, received):
    result = receiver.handle(source, AUTH, build(alert(cls="code", fingerprint="a"),
                                                 alert(cls=None, rule="bad-canary", action="rollback", fingerprint="b")))
    starts = 1767225600.0  # the payloads' startsAt, 2026-01-01T00:00:00Z
    assert received == [AlertAction("fallback", "code", "speedup-below-1", "a", starts),
                        AlertAction("rollback", None, "bad-canary", "b", starts)]
    assert result.actions == received and result.duplicates == 0


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
def test_auth_is_required(authorization, receiver, received):
    with pytest.raises(WebhookError) as err:
        receiver.handle("alertmanager", authorization, alertmanager(alert()))
    assert err.value.status == 401 and received == []


def test_dedupe_by_fingerprint_and_resolved_ignored(receiver, received):
    receiver.handle("alertmanager", AUTH, alertmanager(alert(fingerprint="x")))
    again = receiver.handle("alertmanager", AUTH, alertmanager(alert(fingerprint="x"), alert(cls="code", fingerprint="y")))
    assert again.duplicates == 1 and [a.fingerprint for a in received] == ["x", "y"]
    resolved = receiver.handle("alertmanager", AUTH, alertmanager(alert(status="resolved", fingerprint="x"), status="resolved"))
    assert resolved.actions == [] and resolved.ignored == 1 and len(received) == 2
    # after it resolved, a new firing of the same alert acts again
    receiver.handle("grafana", AUTH, grafana(alert(fingerprint="x")))
    assert [a.fingerprint for a in received] == ["x", "y", "x"]


def test_resolved_alone_never_acts(receiver, received):
    result = receiver.handle("grafana", AUTH, grafana(alert(status="resolved"), status="resolved"))
    assert received == [] and result.ignored == 1


def test_dedupe_memory_expires(received):
    clock = FakeClock()
    rx = WebhookReceiver(TOKEN, received.append, clock=clock, dedupe_ttl_s=60)
    rx.handle("alertmanager", AUTH, alertmanager(alert(fingerprint="x")))
    clock.t = 30
    rx.handle("alertmanager", AUTH, alertmanager(alert(fingerprint="x")))
    clock.t = 61
    rx.handle("alertmanager", AUTH, alertmanager(alert(fingerprint="x")))
    assert len(received) == 2


def test_callback_failure_is_retried_not_deduped(received):
    calls = []

    def flaky(action):
        calls.append(action)
        if len(calls) == 1:
            raise ConnectionError("redis down")

    rx = WebhookReceiver(TOKEN, flaky, clock=FakeClock())
    with pytest.raises(ConnectionError):
        rx.handle("alertmanager", AUTH, alertmanager(alert()))
    assert len(rx.handle("alertmanager", AUTH, alertmanager(alert())).actions) == 1
    assert len(calls) == 2


def test_foreign_alerts_are_ignored(receiver, received):
    result = receiver.handle("alertmanager", AUTH, alertmanager(alert(action=None, rule=None, fingerprint="a"),
                                                                alert(action="", rule=None, fingerprint="b")))
    assert received == [] and result.ignored == 2 and result.rejected == []


@pytest.mark.parametrize("labels", [{"rule": "speedup-below-1"}, {"rule": None}])
def test_unknown_action_label_is_rejected_naming_label_and_value(labels, receiver, received):
    result = receiver.handle("alertmanager", AUTH, alertmanager(alert(action="explode", fingerprint="x", **labels),
                                                                alert(cls="code", fingerprint="y")))
    assert [a.fingerprint for a in received] == ["y"] and result.ignored == 0
    assert len(result.rejected) == 1
    assert "label action='explode' is not one of fallback, rollback, notify" in result.rejected[0]
    # never remembered: every resend is refused again
    again = receiver.handle("grafana", AUTH, grafana(alert(action="explode", fingerprint="x", **labels)))
    assert len(again.rejected) == 1 and again.duplicates == 0 and len(received) == 1


def test_resolved_alert_with_unknown_action_is_ignored(receiver, received):
    result = receiver.handle("alertmanager", AUTH, alertmanager(alert(status="resolved", action="explode"),
                                                                status="resolved"))
    assert result.rejected == [] and result.ignored == 1 and received == []


def test_empty_action_label_takes_the_policys_action(receiver, received):
    receiver.handle("grafana", AUTH, grafana(alert(action="", rule="slower", fingerprint="g")))
    assert [(a.kind, a.rule) for a in received] == [(None, "slower")]


def test_rule_label_without_action_takes_the_policys_action(receiver, received):
    result = receiver.handle("grafana", AUTH, grafana(alert(action=None, rule="slower", fingerprint="g")))
    assert [a.kind for a in received] == [None] and received[0].rule == "slower" and len(result.actions) == 1


def test_start_times_are_parsed_with_nanoseconds_and_zero_means_unknown():
    assert parse_time("2026-01-01T00:00:01.123456789Z") == pytest.approx(1767225601.123456)
    assert parse_time("2026-01-01T01:00:00+01:00") == 1767225600.0
    assert parse_time("0001-01-01T00:00:00Z") is None and parse_time(None) is None
    with pytest.raises(WebhookError) as err:
        parse_time("yesterday")
    assert err.value.status == 400


def test_rejected_alert_is_a_client_error_and_the_others_still_act(received):
    def on_alert(action):
        if action.request_class == "nope":
            raise AlertRejected("alert names class 'nope', which the current policy does not have")
        received.append(action)

    rx = WebhookReceiver(TOKEN + "\n", on_alert, clock=FakeClock())  # a token file's trailing newline is stripped
    result = rx.handle("alertmanager", AUTH, alertmanager(alert(cls="nope", fingerprint="x"),
                                                          alert(cls="code", fingerprint="y")))
    assert [a.fingerprint for a in received] == ["y"] and "nope" in result.rejected[0]
    # not remembered: after the policy gains the class, the resend acts
    again = rx.handle("alertmanager", AUTH, alertmanager(alert(cls="nope", fingerprint="x")))
    assert again.duplicates == 0 and len(again.rejected) == 1


def test_deferred_alert_is_a_503_and_not_remembered():
    leader = {"is": False}
    acted = []

    def on_alert(action):
        if not leader["is"]:
            raise AlertDeferred("not the leader", retry_after_s=2.0)
        acted.append(action)

    rx = WebhookReceiver(TOKEN, on_alert, clock=FakeClock())
    with pytest.raises(WebhookError) as err:
        rx.handle("alertmanager", AUTH, alertmanager(alert()))
    assert err.value.status == 503 and err.value.retry_after_s == 2.0
    leader["is"] = True
    assert len(rx.handle("alertmanager", AUTH, alertmanager(alert())).actions) == 1 and len(acted) == 1


@pytest.mark.parametrize("source, body, message", [
    ("alertmanager", b"{not json", "not JSON"),
    ("alertmanager", b"[]", "JSON object"),
    ("alertmanager", grafana(alert()), "version must be '4'"),
    ("grafana", alertmanager(alert()), "version must be '1'"),
    ("alertmanager", b'{"version": "4", "alerts": {}}', "alerts must be a list"),
    ("alertmanager", alertmanager({"status": "firing", "labels": {"a": 1}}), "labels must be an object of strings"),
    ("alertmanager", alertmanager({"status": "pending", "labels": {}}), "status must be"),
    ("pagerduty", alertmanager(alert()), "unknown webhook source"),
])
def test_malformed_payloads_are_refused(source, body, message):
    with pytest.raises(WebhookError, match=message) as err:
        parse_payload(source, body)
    assert err.value.status in (400, 404)


def test_missing_fingerprint_is_derived_from_labels():
    body = alertmanager({**alert(), "fingerprint": ""}, {**alert(), "fingerprint": None})
    (s1, a1), (s2, a2) = parse_payload("alertmanager", body)
    assert a1.fingerprint == a2.fingerprint and len(a1.fingerprint) == 16


def test_token_and_kind_are_validated():
    with pytest.raises(ValueError, match="token"):
        WebhookReceiver("", lambda a: None)
    with pytest.raises(ValueError, match="kind"):
        AlertAction("explode", None, "r", "f")
