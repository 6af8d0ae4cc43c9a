"""Medusa sweep: speed-up against tree size and head count, measured in one run.

For every head count and tree size the same greedy prompts are decoded with
``method="medusa"`` and the sparse tree of that size (built from the heads' measured
accuracy), alternating prompt by prompt with plain ``ar`` decoding of the same prompt
in the same process; speed-up = ar seconds / medusa seconds over all prompts. The tree the runtime would
pick itself (``tree=None``: sized from the measured verify cost) is one more row, so
the sweep shows whether the cost model lands near the best size.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import click

from specops.spec.tree_size import plan_tree
from specops.spec.tree import preset, sparse_tree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepRow:
    """One (heads, tree) configuration over all prompts."""

    heads: int
    tree: str  # "sparse<N>", a preset name, or "auto"
    tree_nodes: int
    tokens_per_s: float
    ar_tokens_per_s: float
    speedup: float  # ar seconds / medusa seconds, same prompts, same run
    mean_accepted_len: float  # tokens per target forward (prefill included)
    acceptance_rate: float  # accepted / drafted (depth positions)
    exact: bool  # greedy output identical to ar on every prompt


@dataclass
class _Totals:
    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    accepted: int = 0
    drafted: int = 0


def _run(dec, prompt: Sequence[int], max_new_tokens: int, totals: _Totals, **kwargs) -> list[int]:
    out = dec.generate(list(prompt), max_new_tokens=max_new_tokens, **kwargs)
    totals.seconds += out.stats.wall_s
    totals.tokens += out.stats.new_tokens
    totals.forwards += out.stats.target_forwards
    totals.accepted += out.stats.accepted
    totals.drafted += out.stats.drafted
    return out.tokens


def _measure(dec, prompts: Sequence[Sequence[int]], max_new_tokens: int, **medusa_kwargs):
    """ar and medusa on every prompt, alternating prompt by prompt, so that load from other
    processes hits both alike. Returns (ar totals, medusa totals, exact)."""
    ar, med, exact = _Totals(), _Totals(), True
    for prompt in prompts:
        want = _run(dec, prompt, max_new_tokens, ar, method="ar")
        exact &= _run(dec, prompt, max_new_tokens, med, method="medusa", **medusa_kwargs) == want
    return ar, med, exact


def sweep(dec, prompts: Sequence[Sequence[int]], *, heads: Sequence[int] | None = None,
          tree_sizes: Sequence[int] = (1, 2, 4, 6, 8, 12, 16, 24), presets: Sequence[str] = (),
          max_new_tokens: int = 64, repeats: int = 1) -> list[SweepRow]:
    """Rows for every head count x tree (sparse sizes, presets, and "auto"); best of ``repeats``."""
    if dec.medusa is None:
        raise ValueError("the decoder has no Medusa heads to sweep")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    accuracy = dec.medusa.config.head_topk_accuracy
    head_counts = list(heads) if heads else list(range(1, dec.medusa.num_heads + 1))
    dec.generate(list(prompts[0]), method="medusa", max_new_tokens=8)  # warm-up; measures the verify cost once
    rows: list[SweepRow] = []
    for k in head_counts:
        trees: list[tuple[str, object, int]] = [("auto", None, plan_tree(dec.target, dec.medusa, k).num_nodes)]
        if accuracy:
            specs = [(n, sparse_tree(accuracy[:k], n)) for n in tree_sizes]
            trees += [(f"sparse{n}", spec, spec.num_nodes) for n, spec in specs]
        for name in presets:
            spec = preset(name, k)
            trees.append((name, spec, spec.num_nodes))
        for name, tree, nodes in trees:
            runs = [_measure(dec, prompts, max_new_tokens, heads=k, tree=tree) for _ in range(repeats)]
            ar, med, exact = max(runs, key=lambda r: r[0].seconds / r[1].seconds)
            rows.append(SweepRow(
                heads=k, tree=name, tree_nodes=nodes, tokens_per_s=med.tokens / med.seconds,
                ar_tokens_per_s=ar.tokens / ar.seconds, speedup=ar.seconds / med.seconds,
                mean_accepted_len=med.tokens / med.forwards,
                acceptance_rate=med.accepted / med.drafted if med.drafted else 0.0,
                exact=all(r[2] for r in runs),
            ))
            logger.info("medusa sweep %s", rows[-1])
    return rows


def rows_as_dicts(rows: Sequence[SweepRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def plot_sweep(rows: Sequence[SweepRow], path: str | Path) -> Path:
    """Speed-up over ar vs tree size, one line per head count; the auto-sized tree as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({r.heads for r in rows}):
        sparse = sorted((r.tree_nodes, r.speedup) for r in rows if r.heads == k and r.tree.startswith("sparse"))
        if sparse:
            line, = ax.plot([n for n, _ in sparse], [s for _, s in sparse], marker="o", label=f"{k} heads")
            color = line.get_color()
        else:
            color = None
        for r in rows:
            if r.heads == k and r.tree == "auto":
                ax.scatter([r.tree_nodes], [r.speedup], marker="*", s=180, color=color, zorder=3)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("tree nodes (N, root included)")
    ax.set_ylabel("speed-up vs ar (same run)")
    ax.set_title("Medusa: speed-up vs tree size (star = size chosen from measured verify cost)")
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise click.BadParameter("give at least one integer >= 1", param_hint=option)
    return values


@click.command("medusa")
@click.option("--model", default="bundled", show_default=True, help="Target folder, or 'bundled'.")
@click.option("--medusa", "medusa_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="Medusa heads folder (default: the bundled heads).")
@click.option("--suite", type=click.Choice(["code", "prose", "mixed"]), default="code", show_default=True)
@click.option("--limit", type=click.IntRange(1), default=6, show_default=True, help="Prompts from the suite.")
@click.option("--heads", "heads_list", default=None, help="Head counts to sweep, e.g. 1,2,3 (default: all).")
@click.option("--tree-sizes", default="1,2,3,4,6,9,12,16", show_default=True, help="Sparse tree sizes (nodes).")
@click.option("--tree", "presets", default="chain", show_default=True, help="Tree presets to add, comma-separated.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=96, show_default=True)
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_medusa_command(model, medusa_path, suite, limit, heads_list, tree_sizes, presets, max_new_tokens,
                         repeats, threads, json_path, plot_path):
    """Medusa speed-up vs ar over tree sizes and head counts (greedy, same run)."""
    import json

    import torch

    from specops.bench.suites import builtin_suite
    from specops.decoder import Decoder
    from specops.spec.tree import PRESETS

    names = [p.strip() for p in presets.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRESETS]
    if unknown:
        raise click.BadParameter(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}", param_hint="--tree")
    sizes = _int_list(tree_sizes, "--tree-sizes")
    heads = _int_list(heads_list, "--heads") if heads_list else None
    torch.set_num_threads(threads)
    dec = Decoder.from_pretrained(model, medusa=medusa_path)
    if dec.medusa is None or dec.tokenizer is None:
        raise click.ClickException("the model needs Medusa heads and a tokenizer (give --medusa)")
    prompts = [dec.tokenizer.encode(p.text) for p in builtin_suite(suite) if p.temperature == 0][:limit]
    try:
        rows = sweep(dec, prompts, heads=heads, tree_sizes=sizes, presets=names, max_new_tokens=max_new_tokens,
                     repeats=repeats)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{'heads':>5} {'tree':>9} {'nodes':>5} {'tok/s':>8} {'ar tok/s':>8} {'speed-up':>8} "
               f"{'tok/fwd':>7} {'exact':>5}")
    for r in rows:
        click.echo(f"{r.heads:>5} {r.tree:>9} {r.tree_nodes:>5} {r.tokens_per_s:>8.1f} {r.ar_tokens_per_s:>8.1f} "
                   f"{r.speedup:>7.2f}x {r.mean_accepted_len:>7.2f} {str(r.exact):>5}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows_as_dicts(rows), indent=2) + "\n")
    if plot_path:
        click.echo(f"wrote {plot_sweep(rows, plot_path)}")
