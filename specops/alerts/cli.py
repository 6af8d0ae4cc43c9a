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
