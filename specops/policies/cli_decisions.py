"""``specops policy decisions``: the controller's audit stream as a readable log.

Options are parsed here; reading and formatting live in :mod:`specops.policies.audit_log`.
"""

from __future__ import annotations

import json
import re

import click

from specops.policies import audit_log
from specops.policies.cli import _friendly, _opened, _store_options

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: str) -> float:
    """``90`` / ``90s`` / ``15m`` / ``1h`` / ``2d`` -> seconds."""
    m = _DURATION.match(value)
    if not m or float(m.group(1)) <= 0:
        raise click.BadParameter(f"expected a positive duration such as 30s, 15m, 1h or 2d, got {value!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _emit(recs: list[audit_log.LogRecord], as_json: bool) -> None:
    for r in recs:
        click.echo(json.dumps(r.as_dict(), default=str) if as_json else audit_log.format_record(r))


@click.command("decisions")
@click.option("--class", "request_class", default=None, metavar="NAME",
              help="Only this class's decisions (rollout events are always shown).")
@click.option("--since", default="1h", show_default=True, help="How far back: 30s, 15m, 1h, 2d.")
@click.option("--limit", type=click.IntRange(min=1, max=100_000), default=1000, show_default=True,
              help="At most this many stream entries (the newest).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new decisions until Ctrl-C (or --follow-for).")
@click.option("--follow-for", "follow_for_s", type=click.FloatRange(min=0.0), default=None,
              help="With --follow: stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per decision and line.")
@_store_options
@_friendly
def decisions_command(request_class: str | None, since: str, limit: int, follow: bool, follow_for_s: float | None,
                      as_json: bool, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Every decision with its inputs, policy revision and leader epoch (adaptations, fallbacks, alerts,
    analysis runs, rollbacks)."""
    since_s = parse_duration(since)
    if follow_for_s is not None and not follow:
        raise click.UsageError("--follow-for needs --follow")
    with _opened(redis_url, state_dir, namespace) as store:
        entries = audit_log.read_entries(store, since_s=since_s, count=limit)
        recs = audit_log.records(entries, request_class)
        if not recs and not follow and not as_json:
            click.echo(f"no decisions in the last {since}" + (f" for class {request_class}" if request_class else ""))
        _emit(recs, as_json)
        if follow:
            start = entries[-1].id if entries else audit_log.last_id(store)
            try:
                for batch in audit_log.follow(store, start, duration_s=follow_for_s):
                    _emit(audit_log.records(batch, request_class), as_json)
            except KeyboardInterrupt:
                pass  # Ctrl-C ends --follow quietly
