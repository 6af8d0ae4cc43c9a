"""One scenario's outcome: its figures, the goal in words, and whether it was met."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ScenarioResult:
    name: str
    figures: dict[str, Any]
    goal: str
    met: bool
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def format_table(results: list[ScenarioResult]) -> str:
    """A Markdown table: scenario | figures | goal | met."""
    rows = ["| scenario | figures | goal | met |", "|---|---|---|---|"]
    for r in results:
        figures = ", ".join(f"{k} {v}" for k, v in r.figures.items())
        rows.append(f"| {r.name} | {figures} | {r.goal} | {'yes' if r.met else 'NO'} |")
    return "\n".join(rows)
