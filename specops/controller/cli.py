"""``specops controller run`` and ``specops simulate``: option parsing, then one library call each."""

from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path

import click

log = logging.getLogger(__name__)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


@click.command("run")
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False),
              help="Bootstrap policy: stored and made current when the store has no revision yet.")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="Redis URL (redis://, rediss://, unix://, redis+sentinel://, redis+cluster://); none: embedded.")
@click.option("--state-dir", default=".specops", show_default=True, help="Data directory of the embedded Redis.")
@click.option("--namespace", default="specops", show_default=True, help="Key namespace in Redis.")
@click.option("--prometheus", "prometheus_url", default=None, help="Prometheus base URL (read when Redis has no data).")
@click.option("--canary-match", default=None, metavar='LABEL="VALUE"',
              help='PromQL label matchers selecting the canary revision\'s series in Prometheus (e.g. track="canary"); '
                   "with --prometheus the rollout analysis reads them when Redis has no canary data.")
@click.option("--engine-metrics", "engine_specs", multiple=True, metavar="ENGINE[:CLASS]=URL",
              help="Also read vLLM / SGLang speculative-decoding metrics from a pod's /metrics (ENGINE: vllm | "
                   "sglang; without CLASS they count for every class). Repeatable; read after Redis.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds between ticks.")
@click.option("--window", "window_s", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Metrics window per tick, seconds.")
@click.option("--listen", default="127.0.0.1:9464", show_default=True, help="HOST:PORT for /metrics, /healthz, webhooks.")
@click.option("--webhook-token", envvar="SPECOPS_WEBHOOK_TOKEN", default=None,
              help="Bearer token the alert webhooks must carry (env SPECOPS_WEBHOOK_TOKEN).")
@click.option("--lease-ttl-ms", type=click.IntRange(min=100), default=15_000, show_default=True,
              help="Leader lease time-to-live.")
@click.option("--run-for", "run_for_s", type=click.FloatRange(min=0.0), default=None,
              help="Stop after this many seconds (default: until SIGINT/SIGTERM).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: one readable line per event; json: one JSON object per line (for log collectors).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="debug also shows holds and every scheduler run.")
def run_command(policy_file, redis_url, state_dir, namespace, prometheus_url, canary_match, engine_specs, interval_s,
                window_s, listen, webhook_token, lease_ttl_ms, run_for_s, log_format, log_level) -> None:
    """Run the adaptive control loop (leader-elected) with its HTTP server."""
    from prometheus_client import CollectorRegistry

    from specops.alerts.server import ControlServer
    from specops.alerts.webhook import WebhookReceiver
    from specops.controller.controller import Controller
    from specops.controller.engine_sources import engine_sources
    from specops.controller.leader import LeaderLease, LeaseKeeper
    from specops.controller.logs import configure_logging, logged
    from specops.controller.rollout_driver import canary_namespace
    from specops.controller.scheduler import build_scheduler
    from specops.controller.sources import CombinedSource, PrometheusSource, RedisWindowSource
    from specops.policies import PolicyError, load_policy
    from specops.policies import rollout as machine
    from specops.policies.errors import ConflictError, StateError, StoreUnavailableError
    from specops.policies.loader import read_source
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore
    from specops.telemetry.redis_metrics import RedisWindowReader

    host, port = _listen(listen)
    valid_s = lease_ttl_ms * 0.9 / 1000.0  # the lease's validity: ttl minus LeaderLease's 10 % safety margin
    if interval_s >= valid_s:
        # the lease is renewed on its own thread, but a leader that ticks less than once per tenure hands the
        # lease to a standby that has not ticked either (replicas take turns and nobody acts in time)
        raise click.BadParameter(f"--interval {interval_s:g}s cannot keep a {lease_ttl_ms} ms lease (valid "
                                 f"{valid_s:g}s): use a shorter --interval or a longer --lease-ttl-ms",
                                 param_hint="--interval")
    if not webhook_token:
        raise click.UsageError("a webhook token is required: --webhook-token or SPECOPS_WEBHOOK_TOKEN")
    if canary_match is not None and not prometheus_url:
        raise click.UsageError("--canary-match selects series in Prometheus: give --prometheus too")
    configure_logging(log_format, log_level)
    try:
        client = connect(redis_url, state_dir)
    except StoreUnavailableError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        store = PolicyStore(client, namespace=namespace)
        if policy_file and store.current_revision() is None:
            try:
                text, name = read_source(policy_file)
                machine.start_rollout(store, load_policy(policy_file), text, actor="controller-bootstrap")
                click.echo(f"stored {policy_file} as the current policy")
            except ConflictError:
                # Another controller bootstrapped at the same moment; its revision stands.
                if store.current_revision() is None:
                    raise click.ClickException(f"{policy_file}: concurrent bootstrap left no current revision") from None
                click.echo("another controller stored the first policy; using it")
            except (PolicyError, StateError) as exc:
                raise click.ClickException(f"{policy_file}: {exc}") from None
        sources = [RedisWindowSource(RedisWindowReader(client, namespace=namespace))]
        canary = [RedisWindowSource(RedisWindowReader(client, namespace=canary_namespace(namespace)))]
        try:
            sources += engine_sources(engine_specs)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--engine-metrics") from None
        if prometheus_url:
            try:
                sources.append(PrometheusSource(prometheus_url))
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--prometheus") from None
        if canary_match is not None:
            try:
                canary.append(PrometheusSource(prometheus_url, match=canary_match, name="prometheus-canary"))
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--canary-match") from None
        registry = CollectorRegistry()
        lease = LeaderLease(client, name=store.lease_name, ttl_ms=lease_ttl_ms)
        keeper = LeaseKeeper(lease)  # renews on its own thread: a slow tick does not cost the lease
        controller = Controller(store, CombinedSource(sources), registry=registry, lease=lease, window_s=window_s,
                                canary_source=CombinedSource(canary), keeper=keeper)
        context = lambda: (store.current_revision(), lease.epoch)  # noqa: E731 - recorded with each decision
        receiver = WebhookReceiver(webhook_token, logged(controller.apply_alert, context))
        server = ControlServer(receiver, registry, host=host, port=port)
        scheduler = build_scheduler(logged(controller.tick, context), interval_s)
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():  # signals can only be handled there
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        keeper.start()
        server.start()
        scheduler.start()
        click.echo(f"controller running: ticks every {interval_s:g}s, HTTP on {server.url}")
        try:
            stop.wait(run_for_s)
        finally:
            scheduler.shutdown(wait=True)
            server.stop()
            keeper.stop(release=True)
    finally:
        close(client)


@click.command("simulate")
@click.option("--pods", type=click.IntRange(min=1, max=100_000), default=200, show_default=True)
@click.option("--classes", "n_classes", type=click.IntRange(min=1, max=100), default=5, show_default=True)
@click.option("--ticks", type=click.IntRange(min=20, max=100_000), default=100, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seeds", "n_seeds", type=click.IntRange(min=1, max=1000), default=1, show_default=True,
              help="Run this many seeds (--seed, --seed+1, ...) and report mean and minimum against the goals.")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="Redis URL; none: an embedded Redis in a temporary directory.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the figures as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write a PNG of throughput over time (needs matplotlib).")
def simulate_command(pods, n_classes, ticks, seed, n_seeds, redis_url, json_path, plot_path) -> None:
    """Simulate a fleet: the real controller vs fixed settings and the per-class oracle."""
    if n_seeds > 1:
        if plot_path:
            raise click.UsageError("--plot draws one run: use it without --seeds")
        _simulate_seeds(pods, n_classes, ticks, list(range(seed, seed + n_seeds)), redis_url, json_path)
        return
    from specops.controller.sim_model import build_scenario
    from specops.controller.sim_plot import plot_timeline
    from specops.controller.simulator import FleetSimulator
    from specops.policies.errors import StoreUnavailableError
    from specops.policies.redis_backend import close, connect
    from specops.telemetry.keyspace import key_prefix

    try:
        scenario = build_scenario(pods, n_classes, ticks, seed)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="specops-sim-") as state_dir:
        try:
            client = connect(redis_url, state_dir)
        except StoreUnavailableError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            with click.progressbar(length=ticks, label="simulating", file=sys.stderr) as bar:
                namespace = f"sim-{seed}-{pods}x{n_classes}"
                for key in client.scan_iter(f"{key_prefix(namespace)}:*"):  # a re-run starts empty
                    client.delete(key)
                result = FleetSimulator(scenario, client, namespace=namespace,
                                        progress=lambda done: bar.update(done - bar.pos)).run()
        finally:
            close(client)
    fig = result.figures
    tps = fig["tokens_per_s"]
    click.echo(f"fleet tokens/s: adaptive {tps['adaptive']:.0f}, oracle {tps['oracle']:.0f}, "
               f"best fixed ({fig['best_fixed']}) {tps[fig['best_fixed']]:.0f}, plain {tps['fixed_0']:.0f}")
    click.echo(f"adaptive/oracle {fig['adaptive_vs_oracle']:.3f}  adaptive/best fixed {fig['adaptive_vs_best_fixed']:.3f}")
    click.echo(f"fallback detected {fig['fallback_detect_ticks']} ticks after the for-duration; "
               f"bad canary rolled back: {fig['bad_canary_rolled_back']}; "
               f"tick median {fig['tick_ms_median']:.1f} ms (max {fig['tick_ms_max']:.1f})")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({**fig, "timeline": result.timeline}, indent=2))
        click.echo(f"wrote {json_path}")
    if plot_path:
        if plot_timeline(result, plot_path):
            click.echo(f"wrote {plot_path}")
        else:
            click.echo("matplotlib is not installed: no plot (pip install matplotlib)", err=True)


def _simulate_seeds(pods: int, n_classes: int, ticks: int, seeds: list[int], redis_url: str | None,
                    json_path: str | None) -> None:
    from specops.controller.sim_seeds import run_seeds
    from specops.policies.errors import StoreUnavailableError
    from specops.policies.redis_backend import close, connect

    with tempfile.TemporaryDirectory(prefix="specops-sim-") as state_dir:
        try:
            client = connect(redis_url, state_dir)
        except StoreUnavailableError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            with click.progressbar(length=ticks * len(seeds), label=f"simulating {len(seeds)} seeds",
                                   file=sys.stderr) as bar:
                summary = run_seeds(client, pods=pods, n_classes=n_classes, ticks=ticks, seeds=seeds,
                                    progress=lambda done: bar.update(done - bar.pos))
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        finally:
            close(client)
    click.echo(summary.table())
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(summary.as_dict(), indent=2))
        click.echo(f"wrote {json_path}")
