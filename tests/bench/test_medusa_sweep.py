"""The Medusa tree-size sweep: rows per (heads, tree), exactness, and the plot."""

from __future__ import annotations

import torch

from specops.bench.medusa_sweep import plot_sweep, sweep
from specops.decoder import Decoder, MedusaHeads
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)


def test_sweep_rows_and_plot(tmp_path, one_thread):
    model = tiny_model("llama", seed=6)
    heads = MedusaHeads.from_model(model, num_heads=2)
    heads.with_accuracy([[0.6, 0.2], [0.4, 0.1]])
    dec = Decoder(model, medusa=heads)
    prompts = [[1, 2, 3], [7, 7, 9, 4]]
    rows = sweep(dec, prompts, tree_sizes=(1, 3, 5), presets=("chain",), max_new_tokens=12)
    assert [(r.heads, r.tree) for r in rows] == [
        (k, t) for k in (1, 2) for t in ("auto", "sparse1", "sparse3", "sparse5", "chain")
    ]
    assert all(r.exact for r in rows)
    assert all(r.speedup > 0 and r.mean_accepted_len >= 1.0 for r in rows)
    assert {r.tree_nodes for r in rows if r.tree == "sparse5" and r.heads == 1} == {3}  # 1 head, top-2: 3 nodes max
    out = plot_sweep(rows, tmp_path / "sweep.png")
    assert out.stat().st_size > 1000
