"""``specops chaos``: option parsing, then `run_suite`; prints the table, writes JSON."""

from __future__ import annotations

import sys

import click


@click.command("chaos")
@click.option("--quick", is_flag=True, help="Small counts for every scenario (CI; about two minutes).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write {scenarios: [{name, figures, goal, met}]} here.")
@click.option("--only", multiple=True, metavar="NAME", help="Run only this scenario (repeatable).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Keep the services' data and logs here (default: a temporary directory).")
def chaos_command(quick, json_path, only, workdir) -> None:
    """Run failure scenarios against real local processes and report figures against goals."""
    from pathlib import Path

    from specops.chaos.result import format_table
    from specops.chaos.suite import SCENARIOS, run_suite, write_json

    unknown = [n for n in only if n not in SCENARIOS]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(SCENARIOS)}", param_hint="--only")
    results = run_suite(quick=quick, only=list(only) or None, workdir=Path(workdir) if workdir else None,
                        progress=lambda line: click.echo(line, err=True))
    click.echo(format_table(results))
    if json_path:
        write_json(results, json_path)
    if not all(r.met for r in results):
        sys.exit(1)
