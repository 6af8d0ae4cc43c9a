"""Click command ``specops train eagle`` (thin: validate options, call `specops.train.eagle.run_eagle_job`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click

from specops.models.cli import MODEL_FOLDER
from specops.train.cli_options import reply_data_options


@click.command("eagle")
@click.option("--model", "model_ref", required=True,
              help="Target model folder (a Llama-family transformers causal LM) or a registered model's name "
                   "(`specops models list`); it stays frozen.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder  [default: the cache, $SPECOPS_CACHE_DIR/eagle/NAME, for a registered model, "
                   "where `Decoder.from_pretrained(NAME)` finds it; required for a folder]")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=40.0, show_default=True,
              help="Wall budget: target data generation, training and the held-out report together.")
@reply_data_options("Positions of target data (prompt and generated tokens) to collect at most.")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="Stop training after this many steps (default: when the budget is spent).")
@click.option("--shortlist", type=click.IntRange(0), default=8192, show_default=True,
              help="The drafter drafts over the N most frequent target tokens of its data (0: all).")
@click.option("--unroll", type=click.IntRange(1, 8), default=3, show_default=True,
              help="Chain steps trained (1: real features only, as EAGLE-1; more: also its own predictions).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=2, show_default=True, help="torch CPU threads.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True, help="Log progress messages.")
def train_eagle_command(model_ref, out_dir, minutes, tokens, self_prompts, max_batch, steps, shortlist, unroll, seed,
                        threads, quiet, verbose):
    """Train an EAGLE drafter for method `eagle` on the target's own continuations (self-distilled)."""
    from specops.models.eagle_io import default_dir
    from specops.models.resolve import is_registered
    from specops.train.eagle import EagleJob, EagleTrainConfig, run_eagle_job

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registered = is_registered(model_ref)
    model_path = MODEL_FOLDER.convert(model_ref, None, click.get_current_context())
    if out_dir is None:
        if not registered:
            raise click.UsageError("give --out DIR for a model folder (a registered model's drafter goes to the cache)")
        out_dir = default_dir(model_ref)
    cfg = EagleTrainConfig(minutes=minutes, tokens=tokens, self_prompts=self_prompts, max_batch=max_batch, steps=steps,
                           shortlist=shortlist, unroll=unroll, seed=seed, progress=not quiet)
    try:
        cfg.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    job = EagleJob(model=model_path, out_dir=out_dir, model_name=model_ref if registered else "", threads=threads)
    try:
        result = run_eagle_job(job, cfg)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(result, indent=2))
    decode = result.get("heldout_decode") or {}
    top1 = ", ".join(f"{a:.3f}" for a in result["heldout_top1_by_step"])
    click.echo(f"held-out top-1 by chain step: {top1}")
    if decode:
        click.echo(f"held-out greedy eagle (gamma {decode['gamma']}): {decode['tokens_per_target_forward']:.2f} tokens "
                   f"per target forward, acceptance {decode['acceptance_rate']:.3f}, exact {decode['exact_prompts']}")
    click.echo(f"wrote {result['out_dir']} (loss plot: loss.png)")
