"""``specops policy ...``: validate, diff and roll out policies (Argo Rollouts' verbs).

Each command parses its options, opens the store and calls one library function
(``loader``, ``rollout``, ``store``); errors are one readable line on stderr and a
non-zero exit status, never a traceback. ``validate`` prints every problem as
``FILE:LINE: path.to.field: what is wrong``.

State lives in the Redis given by ``--redis URL`` (``SPECOPS_REDIS``), or in an
embedded Redis whose data files are in ``--state-dir`` (``SPECOPS_STATE_DIR``,
default ``./.specops``).

``status`` exit codes: 0 healthy, 1 degraded or aborted (or an error), 3 still
progressing or paused (with ``--wait``: not settled before ``--timeout``). Its class
table and ``--watch`` live in ``status_view``; ``decisions`` in ``cli_decisions``.
"""

from __future__ import annotations

import difflib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import redis
import yaml

from specops.policies import rollout as rollout_sm
from specops.policies.errors import PolicyError, StateError, StoreUnavailableError
from specops.policies.loader import load_policy, read_source
from specops.policies.redis_backend import close, connect
from specops.policies.schema import Policy
from specops.policies.state import RolloutState
from specops.policies.status_view import describe_state, render_status, watch_status
from specops.policies.store import PolicyStore

EXIT_HEALTHY = 0
EXIT_BAD = 1
EXIT_IN_PROGRESS = 3


def _friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's errors into one clear line and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PolicyError as exc:
            for issue in exc.errors:
                click.echo(str(issue), err=True)
            sys.exit(EXIT_BAD)
        except (StateError, StoreUnavailableError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        except redis.RedisError as exc:
            raise click.ClickException(f"Redis error: {exc}") from None

    return wrapper


def _store_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--namespace", envvar="SPECOPS_NAMESPACE", default="specops", show_default=True,
                      help="Key prefix of specops' state in Redis.")(fn)
    fn = click.option("--state-dir", envvar="SPECOPS_STATE_DIR", default=".specops", show_default=True,
                      type=click.Path(file_okay=False), help="Where the embedded Redis keeps its data (no --redis).")(fn)
    fn = click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None, metavar="URL",
                      help="redis://, rediss://, unix://, redis+sentinel://HOST:PORT[,…]/SERVICE or "
                           "redis+cluster://HOST:PORT[,…] URL (with AUTH: redis://:PASSWORD@host:port/db). "
                           "Default: an embedded Redis in --state-dir.")(fn)
    return fn


@contextmanager
def _opened(redis_url: str | None, state_dir: str, namespace: str) -> Iterator[PolicyStore]:
    client = connect(redis_url, state_dir)
    try:
        yield PolicyStore(client, namespace=namespace)
    finally:
        close(client)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def normalised_yaml(policy: Policy) -> str:
    """The policy with every default filled in, in schema order: what a diff should compare."""
    return yaml.safe_dump(policy.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=100)


def exit_code_for(state: RolloutState) -> int:
    if state.phase == "healthy":
        return EXIT_HEALTHY
    if state.phase in ("degraded", "aborted"):
        return EXIT_BAD
    return EXIT_IN_PROGRESS


# --------------------------------------------------------------------------- commands
@click.command("validate")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@_friendly
def validate_command(files: tuple[str, ...]) -> None:
    """Check policy FILES; print every problem as FILE:LINE: field: message (exit 1 if any)."""
    bad = False
    for path in files:
        try:
            policy = load_policy(Path(path), filename=path)
        except PolicyError as exc:
            bad = True
            for issue in exc.errors:
                click.echo(str(issue), err=True)
            continue
        click.echo(f"{path}: ok (version {policy.version}, {len(policy.classes)} classes, "
                   f"{len(policy.alerts)} alerts, {len(policy.rollout.steps)} rollout steps)")
    if bad:
        sys.exit(EXIT_BAD)


@click.command("diff")
@click.argument("file", type=click.Path(dir_okay=False))
@_store_options
@_friendly
def diff_command(file: str, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Show what FILE changes against the current revision (unified diff, defaults filled in)."""
    policy = load_policy(Path(file), filename=file)
    with _opened(redis_url, state_dir, namespace) as store:
        current = store.current_revision()
        old_text, old_label = "", "(no current revision)"
        if current is not None:
            stored = store.get_revision(current)
            old_text, old_label = normalised_yaml(stored.policy), f"revision {current} (version {stored.policy.version})"
    new_text = normalised_yaml(policy)
    lines = list(difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                      fromfile=old_label, tofile=f"{file} (version {policy.version})"))
    if not lines:
        click.echo(f"no changes against {old_label}")
        return
    click.echo("".join(lines), nl=False)


@click.command("rollout")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Evaluate against live metrics and show what would happen; change nothing.")
@click.option("--window", "window_s", type=click.FloatRange(min=1.0), default=None,
              help="Metrics window in seconds for --dry-run (default: the policy's analysis window).")
@_store_options
@_friendly
def rollout_command(file: str, dry_run: bool, window_s: float | None, redis_url: str | None, state_dir: str,
                    namespace: str) -> None:
    """Store FILE as a new revision and start its canary rollout at step 0."""
    text, _ = read_source(Path(file), filename=file)
    policy = load_policy(text, filename=file)
    with _opened(redis_url, state_dir, namespace) as store:
        if dry_run:
            from specops.controller.dry_run import dry_run as evaluate

            click.echo(evaluate(store, policy, window_s or policy.rollout.analysis.window_s))
            return
        state = rollout_sm.start_rollout(store, policy, text)
    click.echo(f"rollout started: {describe_state(state)}")


@click.command("promote")
@click.option("--full", is_flag=True, help="Skip the remaining steps: make the canary current (100%) now.")
@_store_options
@_friendly
def promote_command(full: bool, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Advance the canary one step (or resume it when paused)."""
    with _opened(redis_url, state_dir, namespace) as store:
        state = rollout_sm.promote(store, full=full, reason="promoted --full by operator" if full else "promoted by operator")
    click.echo(describe_state(state))


@click.command("abort")
@click.option("--reason", default="aborted by operator", show_default=True)
@_store_options
@_friendly
def abort_command(reason: str, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Stop the canary: all traffic back on the stable revision."""
    with _opened(redis_url, state_dir, namespace) as store:
        state = rollout_sm.abort(store, reason=reason)
    click.echo(describe_state(state))


@click.command("rollback")
@click.option("--to-revision", type=click.IntRange(min=1), default=None,
              help="Revision to make current (default: the one current before this one).")
@_store_options
@_friendly
def rollback_command(to_revision: int | None, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Make an earlier revision current again (aborting any canary)."""
    with _opened(redis_url, state_dir, namespace) as store:
        state = rollout_sm.rollback(store, to_revision=to_revision, reason="rollback by operator")
    click.echo(describe_state(state))


@click.command("status")
@click.option("--watch", is_flag=True, help="Redraw the status table every --interval until Ctrl-C (or --timeout).")
@click.option("--wait", is_flag=True, help="Poll until the rollout is healthy, degraded, aborted or paused.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.0), default=300.0, show_default=True,
              help="With --wait / --watch: stop after this many seconds (--wait: exit 3 if still progressing).")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="With --wait / --watch: seconds between polls.")
@click.option("--watch-count", type=click.IntRange(min=1), default=None,
              help="With --watch: stop after this many redraws.")
@click.option("--window", "window_s", type=click.FloatRange(min=1.0), default=60.0, show_default=True,
              help="Seconds of telemetry behind the live acceptance / speed-up / tokens/s columns.")
@click.option("--json", "as_json", is_flag=True, help="Print the rollout state and the classes as JSON.")
@_store_options
@_friendly
def status_command(watch: bool, wait: bool, timeout_s: float, interval_s: float, watch_count: int | None,
                   window_s: float, as_json: bool, redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Show the rollout and every class; exit 0 healthy, 1 degraded/aborted, 3 progressing/paused."""
    if watch and wait:
        raise click.UsageError("--watch and --wait are exclusive")
    if watch_count is not None and not watch:
        raise click.UsageError("--watch-count needs --watch")

    with _opened(redis_url, state_dir, namespace) as store:
        state = store.rollout_state()
        if state is None:
            raise StateError("no policy has been rolled out yet")
        if watch:
            state = watch_status(store, window_s=window_s, as_json=as_json, interval_s=interval_s,
                                 timeout_s=timeout_s, count=watch_count, echo=click.echo,
                                 clear=sys.stdout.isatty() and not as_json)
            sys.exit(exit_code_for(state))
        deadline = time.monotonic() + timeout_s
        last = None
        while wait and state.phase == "progressing" and time.monotonic() < deadline:
            if state.generation != last and not as_json:
                click.echo(describe_state(state))
                last = state.generation
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
            state = store.rollout_state() or state
        click.echo(render_status(store, state, window_s=window_s, as_json=as_json))
    if wait and state.phase == "progressing":
        click.echo(f"timed out after {timeout_s:g}s while still progressing", err=True)
    sys.exit(exit_code_for(state))


@click.command("history")
@_store_options
@_friendly
def history_command(redis_url: str | None, state_dir: str, namespace: str) -> None:
    """List stored policy revisions (oldest first)."""
    with _opened(redis_url, state_dir, namespace) as store:
        revisions = store.history()
        current, canary = store.current_revision(), store.canary_revision()
    if not revisions:
        click.echo("no revisions stored")
        return
    click.echo(f"{'REV':>4}  {'CREATED':<20}  {'STATUS':<8}  {'VERSION':<16}  DESCRIPTION")
    for r in revisions:
        status = "current" if r.revision == current else "canary" if r.revision == canary else ""
        desc = r.policy.description.strip().splitlines()[0] if r.policy.description.strip() else ""
        click.echo(f"{r.revision:>4}  {_when(r.created_at):<20}  {status:<8}  {r.policy.version:<16}  {desc}")


@click.command("migrate-keys")
@_store_options
@_friendly
def migrate_keys_command(redis_url: str | None, state_dir: str, namespace: str) -> None:
    """Rename pre-0.2 state keys (ns:current, …) to the hash-tagged layout ({ns}:current, …).

    Stop every controller of the namespace first; runtimes keep their last settings meanwhile.
    """
    from specops.telemetry.keyspace import migrate_legacy_keys

    client = connect(redis_url, state_dir)
    try:
        renamed = migrate_legacy_keys(client, namespace)     # ValueError: both layouts present (one clear line)
    finally:
        close(client)
    for old, new in renamed:
        click.echo(f"{old} -> {new}")
    click.echo(f"{len(renamed)} key(s) renamed" if renamed else f"no keys of the old layout in namespace {namespace!r}")
