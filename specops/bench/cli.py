"""Click command ``specops bench decode`` (thin: validate options, call `run_benchmark`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

METHOD_HELP = ("hf-greedy,hf-assisted,hf-lookup,ar,ar-chain,draft,ngram,ngram-prompt,medusa,auto,eagle,eagle-tree"
               "[,llama.cpp,llama.cpp-spec,llama.cpp-q4,llama-cpp-python,llama-cpp-python-lookup] (ar-chain: a "
               "reference, ar's forwards without its per-token Python; ngram-prompt: ngram without the target's "
               "corpus n-gram store; eagle-tree: eagle drafting EAGLE-2's dynamic tree, --eagle-tree; "
               "llama.cpp*: llama.cpp's own llama-server, built by make peers; "
               "llama-cpp-python*: its Python binding, the peers extra)")


def _tree_shape(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """DEPTH,TOPK,SIZE as three ints (`BenchConfig.validate` checks their ranges)."""
    try:
        shape = tuple(int(part) for part in value.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise click.BadParameter(f"give DEPTH,TOPK,SIZE as three integers, e.g. 5,4,16; got {value!r}")
    return shape


def _model_ref(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A model folder that exists, or a registered model's name."""
    from specops.models import REGISTRY

    if value is None or value in REGISTRY or Path(value).is_dir():
        return value
    raise click.BadParameter(f"{value!r} is neither a folder nor a registered model "
                             f"({', '.join(sorted(REGISTRY))})")


@click.command("decode")
@click.option("--suite", type=click.Choice(["code", "prose", "mixed", "chat", "qa", "creative"]), default="code",
              show_default=True,
              help="With a chat model (its tokenizer has a chat template): chat, code, qa, creative (T=0.8) and "
                   "mixed (all four) are the shipped chat-model suites, rendered with its template.")
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
@click.option("--model", callback=_model_ref, default=None,
              help="Target model folder, or a registered model's name, pulled on first use (`specops models list`; "
                   "default: bundled).")
@click.option("--draft", callback=_model_ref, default=None,
              help="Draft model folder or registered name (default: bundled draft with the bundled target).")
@click.option("--medusa", type=click.Path(exists=True), default=None,
              help="Medusa heads (methods medusa and auto; default: the bundled heads with the bundled target, the "
                   "ones `specops train heads --model NAME --chat` cached for a registered --model).")
@click.option("--eagle", type=click.Path(exists=True, file_okay=False), default=None,
              help="EAGLE drafter folder (methods eagle, eagle-tree and auto; default: the one `specops train eagle "
                   "--model NAME` cached, which auto uses when there is one).")
@click.option("--eagle-tree", "eagle_tree", default="5,4,16", show_default=True, callback=_tree_shape,
              metavar="DEPTH,TOPK,SIZE",
              help="Method eagle-tree's dynamic draft tree: levels drafted, nodes expanded per level (and "
                   "children per node), nodes verified in one target forward (root included).")
@click.option("--gamma", type=int, default=4, show_default=True, help="Draft length (initial, for schedules).")
@click.option("--schedule", type=click.Choice(["constant", "heuristic", "goodput"]), default="constant",
              show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True,
              help="Where the models run: cpu, cuda or cuda:N (the llama.cpp peers need cpu).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--greedy", is_flag=True,
              help="Decode every prompt greedily, the sampled kinds too, so each output is checked against "
                   "transformers' greedy one (an exactness sweep: `make bench-real`).")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_decode_command(suite, methods, max_new_tokens, repeats, json_path, plot_path, prompts_file, model, draft,
                         medusa, eagle, eagle_tree, gamma, schedule, dtype, device, limit, greedy, threads, seed, quiet):
    """Benchmark decoding methods against transformers on the same prompts."""
    from specops.bench.decode import BenchConfig, BenchError, format_table, run_benchmark
    from specops.bench.suites import SuiteError

    logging.basicConfig(level=logging.WARNING)
    cfg = BenchConfig(suite=suite, methods=[m.strip() for m in methods.split(",") if m.strip()],
                      max_new_tokens=max_new_tokens, repeats=repeats, model=model, draft=draft, medusa=medusa, eagle=eagle,
                      eagle_tree=eagle_tree,
                      prompts_file=prompts_file, gamma=gamma, schedule=schedule, dtype=dtype, device=device,
                      seed=seed, threads=threads, limit=limit, greedy=greedy, progress=not quiet)
    try:
        report = run_benchmark(cfg)
    except (BenchError, SuiteError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_table(report))
    if len(report.get("prompt_kinds", [])) > 1:  # per kind: chat turns, a mixed suite's classes
        from specops.bench.chat_suite import format_kind_table

        click.echo(format_kind_table(report))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path:
        from specops.bench.plot import plot_report

        plot_report(report, plot_path)
        click.echo(f"wrote {plot_path}")
