"""The conversation turn of a request, as a request-class attribute (no torch).

In assistant chat, the first reply after a question accepts more speculation than
later turns of the same conversation, so policies may match on the turn
(``match: [{turn: {min: 1, max: 1}}]``).

* Chat requests: the turn is the number of ``assistant`` messages before this
  request + 1 (`turn_from_messages`).
* Plain completions: a request label / header ``turn`` (`TURN_LABEL`) may carry it
  as a positive integer (`turn_from_labels`); anything else counts as unknown.

An unknown turn (None) never satisfies a ``turn`` condition. Telemetry may carry the
turn only bucketed (`turn_bucket`: ``1``, ``2``, ``3+``), so its cardinality is bounded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from specops.telemetry.turn_metrics import TURN_BUCKETS, turn_bucket  # noqa: F401 (telemetry's label values)

TURN_LABEL = "turn"
"""Label / header name that carries the turn of a plain completion request."""
MAX_TURN_LABEL_CHARS = 9


def turn_from_messages(messages: Iterable[Mapping[str, Any]]) -> int:
    """1 + the number of ``assistant`` messages in a chat ``messages`` list.

    Raises ValueError when a message is not a mapping with a string ``role``.
    """
    assistant = 0
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if message["role"] == "assistant":
            assistant += 1
    return assistant + 1


def turn_from_labels(labels: Mapping[str, str] | None) -> int | None:
    """The turn given by the ``turn`` label (a positive decimal integer), else None."""
    if not labels:
        return None
    value = labels.get(TURN_LABEL)
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > MAX_TURN_LABEL_CHARS:
        return None
    turn = int(value)
    return turn if turn >= 1 else None


def resolve_turn(turn: int | None, labels: Mapping[str, str] | None) -> int | None:
    """``turn`` when given (must be >= 1), else the ``turn`` label, else None."""
    if turn is None:
        return turn_from_labels(labels)
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 1:
        raise ValueError(f"turn must be an integer >= 1, got {turn!r}")
    return turn
