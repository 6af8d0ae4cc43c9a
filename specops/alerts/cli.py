"""``specops alerts render``: the click command (validation and output only; logic in render.py)."""

from __future__ import annotations

from pathlib import Path

import click

from specops.alerts.render import FORMATS, RenderError, RenderOptions, render
from specops.policies import PolicyError, load_policy


@click.command("render")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="prometheus", show_default=True,
              help="prometheus: a rule file; prometheus-operator: a PrometheusRule object; grafana: alert provisioning.")
@click.option("--window", default=None, help="PromQL range of the derived series (default: the policy's analysis window).")
@click.option("--interval", default="30s", show_default=True, help="Rule group evaluation interval.")
@click.option("--group", default="specops", show_default=True, help="Rule group name.")
@click.option("--name", default="specops", show_default=True, help="PrometheusRule object name.")
@click.option("--namespace", default=None, help="PrometheusRule namespace.")
@click.option("--datasource-uid", default="prometheus", show_default=True, help="Grafana Prometheus data source uid.")
@click.option("--folder", default="specops", show_default=True, help="Grafana folder for the rules.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write to this file instead of stdout.")
@click.argument("policy", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def render_command(fmt: str, window: str | None, interval: str, group: str, name: str, namespace: str | None,
                   datasource_uid: str, folder: str, output: Path | None, policy: Path) -> None:
    """Render POLICY's alert rules (from the telemetry contract's PromQL)."""
    try:
        loaded = load_policy(policy)
    except PolicyError as exc:
        for issue in exc.errors:
            click.echo(str(issue), err=True)
        raise click.exceptions.Exit(1) from None
    try:
        options = RenderOptions(window=window, interval=interval, group=group, name=name, namespace=namespace,
                                datasource_uid=datasource_uid, folder=folder)
        text = render(loaded, fmt, options)
    except RenderError as exc:
        raise click.ClickException(str(exc)) from None
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)


def _rate_window(value: str) -> str:
    try:
        RenderOptions(window=value)
    except RenderError as exc:
        raise click.BadParameter(str(exc), param_hint="--rate-window") from None
    return value


def _client(prometheus: str):
    from specops.alerts.prometheus_api import PrometheusClient

    try:
        return PrometheusClient(prometheus)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--prometheus") from None


@click.command("snapshot")
@click.option("--prometheus", required=True, envvar="SPECOPS_PROMETHEUS", metavar="URL",
              help="Prometheus base URL that scrapes the runtimes and the controller.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="PNG to write.")
@click.option("--range", "range_s", type=click.FloatRange(min=10.0), default=900.0, show_default=True,
              help="Seconds of history to draw.")
@click.option("--rate-window", default="1m", show_default=True,
              help="PromQL range standing in for Grafana's $__rate_interval (>= 4 scrape intervals).")
def snapshot_command(prometheus: str, out: Path, range_s: float, rate_window: str) -> None:
    """Render the dashboard's main panels to a PNG from Prometheus (no Grafana needed)."""
    from specops.alerts.prometheus_api import PrometheusQueryError
    from specops.alerts.snapshot import SnapshotError, snapshot

    _rate_window(rate_window)
    try:
        counts = snapshot(_client(prometheus), out, range_s=range_s, rate_window=rate_window)
    except (PrometheusQueryError, SnapshotError) as exc:
        raise click.ClickException(str(exc)) from None
    empty = [t for t, n in counts.items() if n == 0]
    click.echo(f"wrote {out}: {len(counts) - len(empty)} of {len(counts)} panels with data"
               + (f" (empty: {', '.join(empty)})" if empty else ""))


@click.command("check")
@click.option("--prometheus", required=True, envvar="SPECOPS_PROMETHEUS", metavar="URL",
              help="Prometheus base URL that scrapes the runtimes and the controller.")
@click.option("--policy", "policy", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Also check this policy's alert rules.")
@click.option("--rate-window", default="1m", show_default=True, help="PromQL range for $__rate_interval.")
def check_command(prometheus: str, policy: Path | None, rate_window: str) -> None:
    """Run every dashboard query (and alert rule) once; exit 1 if any fails or returns nothing."""
    from specops.alerts.snapshot import check_queries

    _rate_window(rate_window)
    loaded = None
    if policy is not None:
        try:
            loaded = load_policy(policy)
        except PolicyError as exc:
            for issue in exc.errors:
                click.echo(str(issue), err=True)
            raise click.exceptions.Exit(1) from None
    report = check_queries(_client(prometheus), rate_window=rate_window, policy=loaded)
    for line in report.lines():
        click.echo(line)
    if report.failed:
        raise click.exceptions.Exit(1)
