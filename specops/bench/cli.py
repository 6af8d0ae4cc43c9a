"""Click command ``specops bench decode`` (thin: validate options, call `run_benchmark`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

METHOD_HELP = ("hf-greedy,hf-assisted,hf-lookup,ar,ar-chain,draft,ngram,ngram-prompt,medusa,auto"
               "[,llama.cpp,llama.cpp-lookup] (ar-chain: a reference, ar's forwards without its per-token Python; "
               "ngram-prompt: ngram without the target's corpus n-gram store; llama.cpp needs the peers "
               "extra: pip install -e \".[peers]\")")


@click.command("decode")
@click.option("--suite", type=click.Choice(["code", "prose", "mixed", "chat"]), default="code", show_default=True)
@click.option("--methods", default="hf-greedy,hf-assisted,hf-lookup,ar,ar-chain,draft,ngram,medusa,auto",
              show_default=True,
              help=f"Comma-separated: {METHOD_HELP}.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG (tokens/s per method, acceptance by draft position).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL with a 'prompt' field, or one prompt per line; replaces --suite.")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Target model folder (default: bundled).")
@click.option("--draft", type=click.Path(exists=True, file_okay=False), default=None,
              help="Draft model folder (default: bundled draft with the bundled target).")
@click.option("--medusa", type=click.Path(exists=True), default=None, help="Medusa heads (method medusa).")
@click.option("--gamma", type=int, default=4, show_default=True, help="Draft length (initial, for schedules).")
@click.option("--schedule", type=click.Choice(["constant", "heuristic", "goodput"]), default="constant",
              show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="Where the models run: cpu, cuda or cuda:N (the llama.cpp peers need cpu).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_decode_command(suite, methods, max_new_tokens, repeats, json_path, plot_path, prompts_file, model, draft,
                         medusa, gamma, schedule, dtype, device, limit, threads, seed, quiet):
    """Benchmark decoding methods against transformers on the same prompts."""
    from specops.bench.decode import BenchConfig, BenchError, format_table, run_benchmark
    from specops.bench.suites import SuiteError

    logging.basicConfig(level=logging.WARNING)
    cfg = BenchConfig(suite=suite, methods=[m.strip() for m in methods.split(",") if m.strip()],
                      max_new_tokens=max_new_tokens, repeats=repeats, model=model, draft=draft, medusa=medusa,
                      prompts_file=prompts_file, gamma=gamma, schedule=schedule, dtype=dtype, device=device,
                      seed=seed, threads=threads, limit=limit, progress=not quiet)
    try:
        report = run_benchmark(cfg)
    except (BenchError, SuiteError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_table(report))
    if suite == "chat" and not prompts_file:
        from specops.bench.chat_suite import format_turn_table

        click.echo(format_turn_table(report))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path:
        from specops.bench.plot import plot_report

        plot_report(report, plot_path)
        click.echo(f"wrote {plot_path}")
