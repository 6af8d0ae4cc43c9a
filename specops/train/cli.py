"""Click commands ``specops train tiny`` and ``specops train draft`` (thin: validate, call one function)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import click


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _command_line(prefix: str, ctx: click.Context) -> str:
    """The command as it ran, rebuilt from its parsed options (for training reports)."""
    import shlex

    parts: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or param.name in ("quiet", "verbose"):
            continue
        default = param.get_default(ctx)
        if param.is_flag:
            if bool(value) != bool(default):
                parts.append(param.opts[0] if value else param.secondary_opts[0])
            continue
        if value is None or value == default or value == ():
            continue
        for item in (value if param.multiple else [value]):
            parts += [param.opts[0], str(item)]
    return prefix + " " + shlex.join(parts)


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
@click.option("--layers", type=int, default=None, help="Draft layers, fewer than the target's  [default: 1; "
              "not with --init-draft, which keeps its own]")
@click.option("--init-draft", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue training this draft instead of starting from the target's first layers.")
@click.option("--data", "data_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text files to distil on (repeat the option, or pass a shell glob).")
@click.option("--stdlib", is_flag=True,
              help="Distil on this interpreter's stdlib (tests held out, as `train tiny`) instead of --data; "
                   "evaluate on the held-out code prompts of `bench decode --suite code`.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", type=int, default=200, show_default=True)
@click.option("--minutes", type=float, default=None, help="Wall budget instead of --steps.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--self-distill", "sd_sequences", type=int, default=0, show_default=True,
              help="Generate this many greedy continuations with the target and train mostly on them (0: off).")
@click.option("--self-distill-share", "sd_share", type=float, default=0.75, show_default=True,
              help="Fraction of every batch's rows taken from the continuations.")
@click.option("--eval-prompts", type=int, default=8, show_default=True, help="Prompts for the acceptance report.")
@click.option("--eval-new-tokens", type=int, default=32, show_default=True,
              help="Greedy tokens per prompt for the acceptance report.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--bf16/--fp32", "bf16", default=False, show_default=True, help="bf16 autocast for training forwards.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("-v", "--verbose", is_flag=True)
def train_draft_command(target_path, layers, init_draft, data_files, stdlib, out_dir, steps, minutes, batch_size, seq_len,
                        lr, sd_sequences, sd_share, eval_prompts, eval_new_tokens, seed, threads, bf16, quiet, verbose):
    """Distil a small draft from any target model (KL to the target's logits)."""
    from specops.train.distill import DraftJob, SelfDistill, distill_from_files
    from specops.train.target import TrainConfig

    _setup_logging(verbose)
    if stdlib == bool(data_files):
        raise click.UsageError("give --data files or --stdlib (one of them)")
    if init_draft is not None and layers is not None:
        raise click.UsageError("--layers cannot be combined with --init-draft (the draft keeps its own layers)")
    for name, value in (("--eval-prompts", eval_prompts), ("--eval-new-tokens", eval_new_tokens)):
        if value < 1:
            raise click.BadParameter("must be >= 1", param_hint=name)
    cfg = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed, minutes=minutes,
                      warmup_fraction=0.02, bf16_autocast=bf16, progress=not quiet)
    job = DraftJob(target=target_path, layers=1 if layers is None else layers, data=list(data_files), out_dir=out_dir,
                   train=cfg, threads=threads, eval_prompts=eval_prompts, eval_new_tokens=eval_new_tokens,
                   init_draft=init_draft, self_distill=SelfDistill(sequences=sd_sequences, share=sd_share),
                   stdlib=stdlib, command=_command_line("specops train draft", click.get_current_context()))
    try:
        summary = distill_from_files(job)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(summary, indent=2))
