"""Click commands ``specops train tiny`` and ``specops train draft`` (thin: validate, call one function)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.command("tiny")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (default: the package's specops/assets).")
@click.option("--minutes", type=float, default=26.0, show_default=True,
              help="Wall-clock budget for target training + draft distillation together.")
@click.option("--target-steps", type=int, default=None,
              help="Fixed target step count (instead of the --minutes budget; exact reproduction).")
@click.option("--draft-steps", type=int, default=None, help="Fixed draft step count (with --target-steps).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True, help="torch CPU threads.")
@click.option("--draft-layers", type=int, default=1, show_default=True)
@click.option("--bf16/--fp32", "bf16", default=True, show_default=True,
              help="bf16 autocast for training forwards (fp32 master weights); saved weights are fp16.")
@click.option("--init-target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue training this target (keeps its tokenizer) instead of starting from scratch.")
@click.option("--max-files", type=int, default=None, help="Use only the first N training files (smoke runs).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress messages.")
def train_tiny_command(out_dir, minutes, target_steps, draft_steps, seed, threads, draft_layers, bf16, init_target, max_files,
                       quiet, verbose):
    """Train the bundled tokenizer, Llama target and distilled draft from stdlib source."""
    from specops.assets import ASSETS_DIR
    from specops.train.tiny import TinyConfig, train_tiny

    _setup_logging(verbose)
    if (target_steps is None) != (draft_steps is None):
        raise click.UsageError("give both --target-steps and --draft-steps, or neither")
    if minutes <= 0:
        raise click.BadParameter("must be > 0", param_hint="--minutes")
    fixed = target_steps is not None
    cfg = TinyConfig(
        out_dir=out_dir or ASSETS_DIR, minutes=None if fixed else minutes, seed=seed, threads=threads,
        draft_layers=draft_layers, bf16_autocast=bf16, init_target=init_target, max_files=max_files, progress=not quiet,
        **({"target_steps": target_steps, "draft_steps": draft_steps} if fixed else {}),
    )
    try:
        report = train_tiny(cfg)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps({k: report[k] for k in ("target", "draft", "wall_s_total")}, indent=2))


@click.command("draft")
@click.option("--target", "target_path", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Target model folder (any transformers causal LM).")
@click.option("--layers", type=int, default=1, show_default=True, help="Draft layers (fewer than the target's).")
@click.option("--data", "data_files", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text files to distil on (repeat the option, or pass a shell glob).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", type=int, default=200, show_default=True)
@click.option("--minutes", type=float, default=None, help="Wall budget instead of --steps.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--bf16/--fp32", "bf16", default=False, show_default=True, help="bf16 autocast for training forwards.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True)
def train_draft_command(target_path, layers, data_files, out_dir, steps, minutes, batch_size, seq_len, lr, seed,
                        threads, bf16, quiet, verbose):
    """Distil a small draft from any target model (KL to the target's logits)."""
    from specops.train.target import TrainConfig
    from specops.train.distill import DraftJob, distill_from_files

    _setup_logging(verbose)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, minutes=minutes,
                      warmup_fraction=0.02, bf16_autocast=bf16, progress=not quiet)
    job = DraftJob(target=target_path, layers=layers, data=list(data_files), out_dir=out_dir, train=cfg,
                   threads=threads)
    try:
        summary = distill_from_files(job)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(summary, indent=2))
