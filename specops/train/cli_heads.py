"""Click command ``specops train heads`` (thin: validate options, call `specops.train.heads.run_heads_job`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from specops.models.cli import MODEL_FOLDER


@click.command("heads")
@click.option("--model", "model_path", required=True, type=MODEL_FOLDER,
              help="Base model folder (any transformers causal LM) or a registered model's name "
                   "(`specops models list`); it stays frozen.")
@click.option("--heads", "num_heads", type=click.IntRange(1, 16), default=3, show_default=True,
              help="K: heads to train (head k predicts k tokens beyond the next).")
@click.option("--data", "data_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text files to train on (repeat the option, or pass a shell glob).")
@click.option("--stdlib", is_flag=True,
              help="Train on this interpreter's stdlib and measure on its held-out files (as `train tiny` "
                   "splits it) instead of --data / --heldout.")
@click.option("--heldout", "heldout_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Held-out text files for the accuracy report (default: the last 5% of --data).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--self-distill", is_flag=True,
              help="Train on the base model's own greedy continuations and soft targets (no original data needed).")
@click.option("--layers", type=click.IntRange(1, 8), default=1, show_default=True, help="Residual blocks per head.")
@click.option("--shared-lm-head", is_flag=True, help="Reuse the base LM head in every head (tiny artifact).")
@click.option("--root-input", is_flag=True,
              help="Heads also read the root (the target's own next token) through the base embedding.")
@click.option("--shortlist", type=click.IntRange(0), default=0, show_default=True,
              help="Heads rank only the N most frequent training tokens when decoding (0: all).")
@click.option("--init-heads", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue these heads (same --layers and --shared-lm-head; --heads at least theirs, extra heads "
                   "start as copies of their last) instead of starting at identity.")
@click.option("--steps", type=click.IntRange(1), default=300, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True)
@click.option("--seq-len", type=click.IntRange(8), default=128, show_default=True)
@click.option("--distill-sequences", type=click.IntRange(1), default=256, show_default=True,
              help="Self-distill: greedy continuations to generate.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Tokenizer folder (default: the model folder, then its parent).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="torch CPU threads.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress messages.")
def train_heads_command(model_path, num_heads, data_files, stdlib, heldout_files, out_dir, self_distill, layers, shared_lm_head,
                        root_input, shortlist, init_heads, steps, batch_size, seq_len, distill_sequences, lr,
                        tokenizer_dir, seed, threads, quiet, verbose):
    """Train Medusa heads on a frozen base model and report per-head top-1/top-5 accuracy."""
    from specops.train.heads import HeadsJob, HeadsTrainConfig, run_heads_job

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = HeadsTrainConfig(num_heads=num_heads, num_layers=layers, shared_lm_head=shared_lm_head, root_input=root_input,
                           shortlist=shortlist,
                           self_distill=self_distill, steps=steps, batch_size=batch_size, seq_len=seq_len,
                           distill_prompt_len=max(1, min(32, seq_len // 4)), distill_sequences=distill_sequences,
                           lr=lr, seed=seed, progress=not quiet)
    try:
        cfg.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if stdlib == bool(data_files):
        raise click.UsageError("give --data files or --stdlib (one of them)")
    if stdlib:
        if heldout_files:
            raise click.UsageError("--stdlib brings its own held-out files: drop --heldout")
        from specops.train.data import split_stdlib

        split = split_stdlib()
        data_files, heldout_files = split.train_files, split.heldout_files
    job = HeadsJob(model=model_path, data_files=tuple(data_files), out_dir=out_dir,
                   heldout_files=tuple(heldout_files), tokenizer=tokenizer_dir, threads=threads, init_heads=init_heads)
    try:
        result = run_heads_job(job, cfg)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(result, indent=2))
    for k in range(num_heads):
        click.echo(f"head {k + 1} (predicts t+{k + 2}): held-out text top-1 {result['text_top1'][k]:.3f} "
                   f"top-5 {result['text_top5'][k]:.3f} | vs base greedy top-1 {result['greedy_top1'][k]:.3f} "
                   f"top-5 {result['greedy_top5'][k]:.3f}")
