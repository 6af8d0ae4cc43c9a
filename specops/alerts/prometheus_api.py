"""A small client for Prometheus' HTTP query API, for the dashboard snapshot and query checks.

Only what those need: instant queries (``/api/v1/query``) and range queries
(``/api/v1/query_range``), answers parsed into typed :class:`Series`. Grafana's
template variables in the dashboard's expressions are filled in by
:func:`fill_variables` (``$__rate_interval`` → a PromQL range, ``$class`` → a regex).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import requests


class PrometheusQueryError(RuntimeError):
    """Prometheus could not be reached, or refused the query (the message says which)."""


@dataclass(frozen=True)
class Series:
    """One labelled time series from a query (an instant query has one point)."""

    labels: dict[str, str]
    times: tuple[float, ...]
    values: tuple[float, ...]
    """NaN where Prometheus answered NaN (a 0/0 ratio)."""


def fill_variables(expr: str, rate_window: str, class_regex: str = ".*") -> str:
    """The expression with Grafana's ``$__rate_interval`` and ``$class`` replaced."""
    return expr.replace("$__rate_interval", rate_window).replace("$class", class_regex)


class PrometheusClient:
    """Queries one Prometheus server (``base_url`` like ``http://127.0.0.1:9090``)."""

    def __init__(self, base_url: str, timeout_s: float = 10.0, session: requests.Session | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()

    def _get(self, path: str, params: dict) -> dict:
        url = f"{self.base_url}{path}"
        try:
            resp = self.session.get(url, params=params, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise PrometheusQueryError(f"cannot reach Prometheus at {self.base_url}: {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            raise PrometheusQueryError(f"{url}: HTTP {resp.status_code}, not a JSON answer") from None
        if body.get("status") != "success":
            raise PrometheusQueryError(f"query refused: {body.get('errorType', '?')}: {body.get('error', '?')}")
        return body.get("data") or {}

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant query (vector answers only)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        if data.get("resultType") not in ("vector", "scalar"):
            raise PrometheusQueryError(f"unexpected result type {data.get('resultType')!r} for {expr}")
        if data.get("resultType") == "scalar":
            t, v = data["result"]
            return [Series({}, (float(t),), (_float(v),))]
        return [Series(dict(r.get("metric", {})), (float(r["value"][0]),), (_float(r["value"][1]),))
                for r in data.get("result", [])]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Series]:
        """A range query: every series with its points between ``start`` and ``end``."""
        if step_s <= 0 or end < start:
            raise ValueError(f"bad range: start {start}, end {end}, step {step_s}")
        data = self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{step_s:g}"})
        out = []
        for r in data.get("result", []):
            points = r.get("values", [])
            out.append(Series(dict(r.get("metric", {})), tuple(float(t) for t, _ in points),
                              tuple(_float(v) for _, v in points)))
        return out


def _float(raw: str) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):
        return math.nan
