"""Fuzzed alert-webhook bodies (hypothesis), then schemathesis on both servers' OpenAPI documents.

Bodies are raw bytes, arbitrary JSON, and payloads shaped like Alertmanager's and
Grafana's (right and wrong versions, labels naming real and unknown actions and
classes, odd timestamps), each sent with the right bearer token so the parser, not
the auth check, answers. Then `specops.chaos.openapi_fuzz` fuzzes every operation of
the controller's ``/openapi.json`` and of ``specops serve``'s (positive and negative
cases, right secrets; ``cap_tokens`` lowers the generation length of serve's cases, for
the quick run). Figures: 5xx answers, transport errors, 4xx answers not in the
server's error shape (``{"error": "..."}`` for the controller, OpenAI's
``{"error": {"message", "type", ...}}`` for serve), and whether both processes
survived. The examples are derandomized, so a run is repeatable.
"""

from __future__ import annotations

import json

import httpx

from specops.chaos.result import ScenarioResult
from specops.chaos.rig import Rig

NAME = "fuzzed webhook bodies + OpenAPI (schemathesis)"


def _strategies():
    """(source, body bytes): mostly well-formed deliveries with fuzzed contents, some malformed ones."""
    from hypothesis import strategies as st

    from specops.alerts.webhook import SOURCES

    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
    anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                            max_leaves=12)
    words = st.one_of(st.sampled_from(["fallback", "rollback", "notify", "code", "general", "factual", "no-such-class",
                                       "low-acceptance", "slower-than-plain", "no-such-rule", ""]), st.text(max_size=12))
    labels = st.dictionaries(st.sampled_from(["alertname", "class", "action", "rule", "severity", "x"]), words,
                             max_size=5)
    times = st.one_of(st.sampled_from(["2026-01-01T00:00:00Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z",
                                       "yesterday", ""]), anything)
    alert = st.fixed_dictionaries({"status": st.sampled_from(["firing", "resolved"]), "labels": labels}, optional={
        "startsAt": times, "endsAt": times, "fingerprint": st.one_of(st.text(max_size=16), anything),
        "annotations": anything})
    odd_alert = st.fixed_dictionaries({}, optional={"status": anything, "labels": st.one_of(labels, anything)})

    def delivery(source: str, alerts):
        return st.fixed_dictionaries({"version": st.just(SOURCES[source]), "alerts": alerts},
                                     optional={"status": anything, "groupLabels": anything, "receiver": anything})

    def encoded(strategy):
        return strategy.map(lambda v: json.dumps(v).encode())

    cases = [st.tuples(st.just(source), encoded(delivery(source, st.lists(alert, max_size=4))))
             for source in SOURCES]
    cases += [st.tuples(st.just(source), encoded(delivery(source, st.lists(st.one_of(alert, odd_alert), max_size=4))))
              for source in SOURCES]
    cases += [st.tuples(st.sampled_from(sorted(SOURCES)),
                        st.one_of(encoded(anything), encoded(st.fixed_dictionaries({"version": anything,
                                                                                    "alerts": anything})),
                                  st.binary(max_size=200)))]
    return st.one_of(*cases)


def _controller_error(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), str)


def _openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def run(rig: Rig, *, bodies: int, openapi_examples: int, cap_tokens: int | None = None) -> ScenarioResult:
    from hypothesis import HealthCheck, given, settings

    from specops.chaos.openapi_fuzz import fuzz

    controller = rig.ensure_controller()
    serve = rig.ensure_serve()
    headers = {"Authorization": f"Bearer {rig.webhook_token}", "Content-Type": "application/json"}
    sent, server_errors, statuses, transport = [0], [], {}, []
    client = httpx.Client(timeout=30)

    @settings(max_examples=bodies, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(_strategies())
    def send(case) -> None:
        source, body = case
        sent[0] += 1
        try:
            r = client.post(f"{controller.url}/webhook/{source}", content=body, headers=headers)
        except httpx.HTTPError as exc:
            transport.append(repr(exc))
            return
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            server_errors.append(f"{r.status_code} {body[:120]!r} -> {r.text[:120]}")

    try:
        send()
    finally:
        client.close()
    apis = {"controller": fuzz(f"{controller.url}/openapi.json", controller.url, examples=openapi_examples,
                               headers={"Authorization": f"Bearer {rig.webhook_token}"}, shape=_controller_error),
            "serve": fuzz(f"{serve.url}/openapi.json", serve.url, examples=openapi_examples, headers=rig.auth,
                          shape=_openai_error, cap_tokens=cap_tokens)}
    alive = controller.alive() and serve.alive()
    api_5xx = sum(r.five_xx for r in apis.values())
    api_transport = sum(len(r.transport_errors) for r in apis.values())
    api_shape = sum(len(r.bad_error_shape) for r in apis.values())
    figures = {"bodies": sent[0], "5xx": len(server_errors), "transport_errors": len(transport),
               "statuses": dict(sorted(statuses.items())),
               "openapi_operations": {k: r.operations for k, r in apis.items()},
               "openapi_cases": {k: r.cases for k, r in apis.items()}, "openapi_5xx": api_5xx,
               "openapi_transport_errors": api_transport, "openapi_4xx_not_error_shape": api_shape,
               "openapi_statuses": {k: dict(sorted(r.statuses.items())) for k, r in apis.items()},
               "crashed": int(not alive)}
    met = (sent[0] >= min(bodies, 50) and not server_errors and not transport and alive and api_5xx == 0
           and api_transport == 0 and api_shape == 0 and all(r.cases > 0 for r in apis.values()))
    notes = server_errors + transport + [n for r in apis.values()
                                         for n in r.server_errors + r.transport_errors + r.bad_error_shape]
    return ScenarioResult(NAME, figures, "0 5xx, 0 crashes, 4xx in the error shape", met, notes=notes[:8])
