"""Webhook payloads in the shapes Alertmanager (version "4") and Grafana (version "1") send."""

from __future__ import annotations

import json


def alert(status="firing", cls="chat", rule="speedup-below-1", action="fallback", fingerprint="fp-1", **extra):
    labels = {"alertname": "SpecopsSpeedupBelow1", "severity": "critical", "source": "specops"}
    if cls is not None:
        labels["class"] = cls
    if rule is not None:
        labels["rule"] = rule
    if action is not None:
        labels["action"] = action
    labels.update(extra)
    return {"status": status, "labels": labels, "annotations": {"summary": "speedup < 1"},
            "startsAt": "2026-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus/graph", "fingerprint": fingerprint}


def alertmanager(*alerts, status="firing") -> bytes:
    return json.dumps({
        "version": "4", "groupKey": '{}:{alertname="SpecopsSpeedupBelow1"}', "truncatedAlerts": 0,
        "status": status, "receiver": "specops", "groupLabels": {"alertname": "SpecopsSpeedupBelow1"},
        "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://alertmanager", "alerts": list(alerts),
    }).encode()


def grafana(*alerts, status="firing") -> bytes:
    return json.dumps({
        "receiver": "specops", "status": status, "orgId": 1, "alerts": list(alerts), "groupLabels": {},
        "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://grafana/", "version": "1",
        "groupKey": "{}", "truncatedAlerts": 0, "title": "[FIRING:1]", "state": "alerting", "message": "",
    }).encode()
