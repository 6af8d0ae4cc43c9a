"""Derived series of the controller's own metrics (`specops.controller.metrics`), for the
dashboard and the operator's view; ``$match`` / ``$window`` as in
`specops.telemetry.contract.promql`::

    controller_fallbacks_active  max by (class) (specops_controller_fallbacks_active)     1 = fallen back
    controller_knob              max by (class, knob) (specops_controller_knob)           γ / heads set
    controller_decisions         sum by (class, kind) (increase(decisions_total[window]))  holds included
"""

from __future__ import annotations

from string import Template

#: Derived series of the controller's metrics, keyed like `specops.telemetry.contract.PROMQL`.
PROMQL: dict[str, str] = {
    "controller_fallbacks_active": "max by (class) (specops_controller_fallbacks_active{$match})",
    "controller_knob": "max by (class, knob) (specops_controller_knob{$match})",
    "controller_decisions": "sum by (class, kind) (increase(specops_controller_decisions_total{$match}[$window]))",
}


def promql(name: str, window: str = "5m", match: str = "") -> str:
    """The PromQL of controller series ``name`` (see the module docstring)."""
    if name not in PROMQL:
        raise KeyError(f"unknown controller series {name!r}; known: {', '.join(sorted(PROMQL))}")
    return Template(PROMQL[name]).substitute(window=window, match=match).replace("{}", "")
