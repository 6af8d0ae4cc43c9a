"""schemathesis through `specops.chaos.openapi_fuzz` against the controller's real HTTP server (in-process)."""

from __future__ import annotations

import pytest

from specops.alerts.server import ControlServer
from specops.alerts.webhook import WebhookReceiver
from tests.services import require_module

require_module("schemathesis", "fuzzing the OpenAPI documents")

from specops.chaos.openapi_fuzz import fuzz  # noqa: E402


def _error_shape(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), str)


@pytest.fixture
def server():
    received = []
    srv = ControlServer(WebhookReceiver("tok", received.append)).start()
    yield srv, received
    srv.stop()


def test_controller_openapi_fuzz_finds_no_5xx_and_only_error_shaped_4xx(server):
    srv, _ = server
    report = fuzz(f"{srv.url}/openapi.json", srv.url, headers={"Authorization": "Bearer tok"}, examples=8,
                  shape=_error_shape)
    # every documented operation but the document itself (schemathesis leaves its own URL out)
    assert report.operations == 4 and report.cases >= 20
    assert report.server_errors == [] and report.transport_errors == [] and report.bad_error_shape == []
    assert report.statuses.get(200, 0) > 0 and report.statuses.get(400, 0) > 0  # positive and negative cases


def test_a_5xx_is_counted():
    with_problem = ControlServer(WebhookReceiver("tok", lambda a: None), health=lambda: "broken on purpose").start()
    try:  # /healthz answers 503 without Retry-After: a server error by the fuzzer's rule
        report = fuzz(f"{with_problem.url}/openapi.json", with_problem.url, headers={}, examples=2)
    finally:
        with_problem.stop()
    assert report.five_xx >= 1 and any("/healthz" in e for e in report.server_errors)


@pytest.mark.parametrize("body,after", [
    ({"prompt": "x"}, {"prompt": "x", "max_tokens": 4}),
    ({"max_tokens": 900}, {"max_tokens": 4}),
    ({"max_tokens": 2, "max_completion_tokens": 10**9}, {"max_tokens": 2, "max_completion_tokens": 4}),
    ({"max_tokens": -5}, {"max_tokens": -5}),  # a negative case stays what it was generated to be
    ({"max_tokens": "many"}, {"max_tokens": "many"}),
    ({"max_tokens": True}, {"max_tokens": True}),
    ([1, 2], [1, 2]),
])
def test_cap_generation_lowers_only_large_token_limits(body, after):
    from specops.chaos.openapi_fuzz import cap_generation

    cap_generation(body, 4)
    assert body == after
