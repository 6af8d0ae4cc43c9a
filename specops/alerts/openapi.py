"""The OpenAPI 3.0 description of the controller's HTTP server (`specops.alerts.server`).

Served at ``GET /openapi.json`` so clients and fuzzers (schemathesis, in ``specops
chaos``) read the same contract the server keeps: every route, its bearer security,
its request body and every status it may answer. The webhook bodies are the parts of
Alertmanager's (version "4") and Grafana's (version "1") payloads the controller
reads (`specops.alerts.webhook.parse_payload`); other fields are allowed and ignored.
"""

from __future__ import annotations

from typing import Any

from specops.alerts.webhook import MAX_BODY_BYTES, SOURCES

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_ANSWER = {"type": "object", "required": ["actions", "duplicates", "ignored"],
           "properties": {"actions": {"type": "integer"}, "duplicates": {"type": "integer"},
                          "ignored": {"type": "integer"}, "error": {"type": "string"},
                          "rejected": {"type": "array", "items": {"type": "string"}}}}


def _json(description: str, schema: dict[str, Any], headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _payload(version: str) -> dict[str, Any]:
    alert = {"type": "object", "required": ["status", "labels"], "properties": {
        "status": {"type": "string", "enum": ["firing", "resolved"]},
        "labels": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "``action`` (fallback | rollback | notify), ``rule`` or ``alertname``, ``class``"},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "startsAt": {"type": "string", "description": "RFC 3339 time with a zone"},
        "endsAt": {"type": "string"},
        "fingerprint": {"type": "string"}}}
    return {"type": "object", "required": ["version", "alerts"], "properties": {
        "version": {"type": "string", "enum": [version]},
        "status": {"type": "string"}, "receiver": {"type": "string"},
        "groupLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "alerts": {"type": "array", "items": alert}}}


def _webhook(source: str, version: str) -> dict[str, Any]:
    retry = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    return {"post": {
        "operationId": f"webhook_{source}",
        "summary": f"{source} alert delivery (payload version {version!r})",
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _payload(version)}}},
        "responses": {
            "200": _json("alerts applied (or ignored / duplicates)", _ANSWER),
            "400": _json("malformed payload", _ERROR),
            "401": _json("missing or wrong bearer token", _ERROR),
            "408": _json("the body stopped arriving (each read has a time limit)", _ERROR),
            "413": _json(f"body over {MAX_BODY_BYTES} bytes", _ERROR),
            "422": _json("an alert names an unknown class, rule or action", _ANSWER),
            "503": _json("not now (not the leader, Redis down): retry", _ERROR, retry),
        }}}


def openapi_document() -> dict[str, Any]:
    """The document ``GET /openapi.json`` answers."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths: dict[str, Any] = {
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics of the controller",
                             "responses": {"200": {"description": "text exposition format", "content": text}}}},
        "/healthz": {"get": {"operationId": "healthz", "summary": "liveness",
                             "responses": {"200": {"description": "ok", "content": text},
                                           "503": {"description": "unhealthy, with the reason", "content": text}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "this document",
                                  "responses": {"200": {"description": "OpenAPI 3.0",
                                                        "content": {"application/json": {"schema": {
                                                            "type": "object"}}}}}}},
    }
    for source, version in SOURCES.items():
        paths[f"/webhook/{source}"] = _webhook(source, version)
    return {"openapi": "3.0.3",
            "info": {"title": "specops controller", "version": "1",
                     "description": "Metrics, health and the alert webhooks of `specops controller run`."},
            "paths": paths,
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
