"""Medusa sweep: speed-up against tree size and head count, measured in one run.

For every head count and tree size the same greedy prompts are decoded with
``method="medusa"`` and the sparse tree of that size (built from the heads' measured
accuracy), next to plain ``ar`` decoding of the same prompts in the same process;
speed-up = ar seconds / medusa seconds over all prompts. The tree the runtime would
pick itself (``tree=None``: sized from the measured verify cost) is one more row, so
the sweep shows whether the cost model lands near the best size.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from specops.decoder.medusa_decode import plan_tree
from specops.decoder.tree import preset, sparse_tree

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


def _decode_all(dec, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs):
    seconds, tokens, forwards, accepted, drafted, outputs = 0.0, 0, 0, 0, 0, []
    for prompt in prompts:
        out = dec.generate(list(prompt), max_new_tokens=max_new_tokens, **kwargs)
        seconds += out.stats.wall_s
        tokens += out.stats.new_tokens
        forwards += out.stats.target_forwards
        accepted += out.stats.accepted
        drafted += out.stats.drafted
        outputs.append(out.tokens)
    return seconds, tokens, forwards, accepted, drafted, outputs


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
    _decode_all(dec, prompts[:1], 8, method="medusa")  # warm-up: measures the verify-cost curve once
    ar_runs = [_decode_all(dec, prompts, max_new_tokens, method="ar") for _ in range(repeats)]
    ar_s = min(run[0] for run in ar_runs)
    ar_tokens, ar_out = ar_runs[0][1], ar_runs[0][5]
    rows: list[SweepRow] = []
    for k in head_counts:
        trees: list[tuple[str, object, int]] = [("auto", None, 0)]
        if accuracy:
            specs = [(n, sparse_tree(accuracy[:k], n)) for n in tree_sizes]
            trees += [(f"sparse{n}", spec, spec.num_nodes) for n, spec in specs]
        for name in presets:
            spec = preset(name, k)
            trees.append((name, spec, spec.num_nodes))
        for name, tree, nodes in trees:
            best = None
            for _ in range(repeats):
                run = _decode_all(dec, prompts, max_new_tokens, method="medusa", heads=k, tree=tree)
                best = run if best is None or run[0] < best[0] else best
            seconds, tokens, forwards, accepted, drafted, outputs = best
            if name == "auto":
                nodes = plan_tree(dec.target, dec.medusa, k).num_nodes
            rows.append(SweepRow(
                heads=k, tree=name, tree_nodes=nodes, tokens_per_s=tokens / seconds,
                ar_tokens_per_s=ar_tokens / ar_s, speedup=ar_s / seconds,
                mean_accepted_len=tokens / forwards, acceptance_rate=accepted / drafted if drafted else 0.0,
                exact=outputs == ar_out,
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
