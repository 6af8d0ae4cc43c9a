"""schemathesis against a live server's own OpenAPI document.

Every operation of the document is fuzzed in schemathesis' positive mode (requests the
schema allows) and negative mode (requests it forbids: wrong types, missing fields,
out-of-range values), ``examples`` cases per operation and mode, derandomized so a run
is repeatable. Each case is sent to the live process with the given headers (the right
secret, so the handler, not the auth check, answers). Counted: answers by status,
5xx answers, transport errors (a crash or a hang shows as one), and 4xx answers not in
the error shape the server promises (``shape``: a predicate on the parsed JSON body).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    bad_error_shape: list[str] = field(default_factory=list)
    operations: int = 0

    @property
    def five_xx(self) -> int:
        return len(self.server_errors)


TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")


def cap_generation(body: Any, cap: int) -> None:
    """Lower (or set) the token limits of an OpenAI-style JSON body to ``cap``, in place; others untouched."""
    if not isinstance(body, dict):
        return
    present = [k for k in TOKEN_LIMITS if k in body]
    for key in present:
        value = body[key]
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if not present:
        body["max_tokens"] = cap


def fuzz(schema_url: str, base_url: str, *, headers: dict[str, str], examples: int,
         shape: Callable[[Any], bool] | None = None, timeout_s: float = 60.0,
         cap_tokens: int | None = None) -> FuzzReport:
    """Fuzz every operation of the document at ``schema_url`` against ``base_url``.

    ``cap_tokens``: lower the generation length of every case to this (`cap_generation`), so a
    small run is not spent decoding; None sends the cases as generated.
    """
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(schema_url, timeout=30)
    report = FuzzReport()
    session = requests.Session()

    def send(case) -> None:
        report.cases += 1
        if cap_tokens is not None:
            cap_generation(case.body, cap_tokens)
        what = f"{case.method} {case.formatted_path} body={str(case.body)[:100]!r}"
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=timeout_s)
        except requests.RequestException as exc:
            report.transport_errors.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            return
        code = response.status_code
        report.statuses[code] = report.statuses.get(code, 0) + 1
        if code >= 500 and code != 503:  # 503 + Retry-After is "not now" (loading, not the leader), by contract
            report.server_errors.append(f"{code} {what} -> {response.text[:160]}")
        elif code == 503 and "retry-after" not in {k.lower() for k in response.headers}:
            report.server_errors.append(f"503 without Retry-After {what} -> {response.text[:160]}")
        elif 400 <= code < 500 and shape is not None:
            try:
                ok = shape(response.json())
            except ValueError:
                ok = False
            if not ok:
                report.bad_error_shape.append(f"{code} {what} -> {response.text[:160]}")

    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            report.operations += 1
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                run = settings(max_examples=examples, database=None, derandomize=True, deadline=None,
                               suppress_health_check=list(HealthCheck), phases=["explicit", "generate"])(
                    given(operation.as_strategy(generation_mode=mode))(send))
                try:
                    run()
                except Unsatisfiable:  # nothing to break (negative mode on an operation without inputs)
                    pass
    finally:
        session.close()
    return report
