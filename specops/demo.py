"""``specops demo``: the bundled models, plain vs speculative decoding, on mixed prompts.

`run_decode_demo` is the core (a list of table rows); `demo_command` prints it. The
prompts mix code, docstring prose and high-temperature sampling, so the table shows
what the mission says to expect: code accepts far more than prose, and hot sampling
accepts least.

``--model NAME|PATH`` runs the same on a real model (`DemoModel`): the methods it has
without a draft model (plain, n-gram lookup, and EAGLE when a drafter was trained for it),
prompts from the chat-model suites rendered with its chat template when it has one, and
``specops serve`` in the ops part loading that model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import click

DEMO_METHODS = ("hf-greedy", "ar", "draft", "ngram", "medusa", "auto")
DEMO_MIX = {"code": 3, "prose": 2, "hot": 2}   # prompts per kind
MODEL_METHODS = ("hf-greedy", "ar", "ngram")  # a model's methods without a draft model (+ eagle when trained)
CHAT_DEMO_MIX = {"chat": 2, "code": 2, "qa": 2, "creative": 1}  # prompts per class, chat-model suites


def demo_prompts(seed: int = 0) -> list:
    """A short mixed set from the built-in ``mixed`` suite (held-out stdlib tests)."""
    from specops.bench.suites import builtin_suite

    chosen, taken = [], {k: 0 for k in DEMO_MIX}
    for prompt in builtin_suite("mixed", seed=seed):
        if taken.get(prompt.kind, 0) < DEMO_MIX.get(prompt.kind, 0):
            chosen.append(prompt)
            taken[prompt.kind] += 1
    return chosen


def chat_demo_prompts(tokenizer: Any) -> list:
    """For a chat model: the first prompts of each class of the chat-model ``mixed`` suite
    (`CHAT_DEMO_MIX`), rendered with ``tokenizer``'s chat template; each prompt's kind is its
    class (the ``chat`` class's turns ``turn1`` / ``turn2`` / ... count as ``chat``)."""
    from specops.bench.chat_suite import chat_model_suite, prompt_class

    chosen, taken = [], {k: 0 for k in CHAT_DEMO_MIX}
    for prompt in chat_model_suite("mixed", tokenizer):
        kind = prompt_class(prompt.kind)
        if taken.get(kind, 0) < CHAT_DEMO_MIX.get(kind, 0):
            chosen.append(replace(prompt, kind=kind))
            taken[kind] += 1
    return chosen


@dataclass(frozen=True)
class DemoModel:
    """What ``specops demo --model`` runs on a model other than the bundled pair."""

    ref: str                   # what --model named: a registered model's name, or a folder
    folder: Path               # the model's folder (a registered model's cache folder)
    methods: tuple[str, ...]   # `MODEL_METHODS`, + eagle when a trained drafter is cached for it
    chat: bool                 # its tokenizer has a chat template: chat-model prompts, chat requests
    prompts: list              # the decoding table's prompts
    mix: dict[str, int]        # prompts per kind
    eagle_note: str            # one line on the EAGLE drafter: used, or why not


def demo_model(ref: str, *, progress: bool = True) -> DemoModel:
    """``ref`` (a registered name, pulled on first use, or a model folder) as the demo runs it.
    Raises `specops.bench.decode.BenchError` for a folder that holds no model."""
    from transformers import AutoTokenizer

    from specops.bench.chat_suite import has_chat_template
    from specops.bench.decode import BenchError
    from specops.decoder.api import EAGLE_TRAIN_COMMAND
    from specops.models.eagle_io import default_dir, is_drafter_dir
    from specops.models import ModelsError, is_registered, resolve_model

    registered = is_registered(ref)
    try:
        folder = Path(resolve_model(ref, progress=progress))
    except ModelsError as exc:
        raise BenchError(str(exc)) from None
    if not (folder / "config.json").is_file():
        raise BenchError(f"no model at {folder} (config.json missing)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load the tokenizer in {folder}: {exc}") from None
    methods = MODEL_METHODS
    if not registered:
        note = (f"eagle: left out (drafters are cached per registered model, `{EAGLE_TRAIN_COMMAND}`; "
                "a folder has none)")
    elif is_drafter_dir(default_dir(ref)):
        methods += ("eagle",)
        note = f"eagle: the drafter in {default_dir(ref)}"
    else:
        train = EAGLE_TRAIN_COMMAND.replace("NAME", ref)
        note = f"eagle: left out (no trained drafter in {default_dir(ref)}; `{train}` trains one)"
    chat = has_chat_template(tokenizer)
    if chat:
        prompts, mix = chat_demo_prompts(tokenizer), dict(CHAT_DEMO_MIX)
    else:  # a completion model: the standard-library mix, as for the bundled models
        prompts, mix = demo_prompts(), dict(DEMO_MIX)
    folder = folder.resolve()
    return DemoModel(ref=ref if registered else str(folder), folder=folder, methods=methods, chat=chat,
                     prompts=prompts, mix=mix, eagle_note=note)


def run_decode_demo(*, max_new_tokens: int = 64, gamma: int = 4, repeats: int = 1, methods=DEMO_METHODS,
                    model: str | None = None, draft: str | None = None, progress: bool = True,
                    seed: int = 0, prompts: Sequence | None = None,
                    kinds: Sequence[str] = tuple(DEMO_MIX)) -> list[dict]:
    """Decode the demo prompts (default `demo_prompts`) with every method; one row per method:
    ``method``, ``tokens_per_s``, ``speedup`` (vs transformers' greedy ``generate``),
    ``speedup_vs_ar`` (vs our own plain decoding), ``acceptance_rate``, ``mean_accepted_len``,
    ``exact_match`` and the acceptance per prompt kind of ``kinds`` (``acceptance_code`` /
    ``acceptance_prose`` / ``acceptance_hot`` by default)."""
    from specops.bench.decode import BenchConfig, run_benchmark

    cfg = BenchConfig(suite="mixed", methods=list(methods), max_new_tokens=max_new_tokens, repeats=repeats,
                      gamma=gamma, model=model, draft=draft, progress=progress, seed=seed, measure_bandwidth=False)
    report = run_benchmark(cfg, prompts=demo_prompts(seed) if prompts is None else list(prompts))
    rows = []
    for r in report["results"]:
        row = {k: r[k] for k in ("method", "tokens_per_s", "speedup", "speedup_vs_ar", "acceptance_rate",
                                 "mean_accepted_len", "exact_match")}
        for kind in kinds:
            row[f"acceptance_{kind}"] = r["by_kind"].get(kind, {}).get("acceptance_rate")
        rows.append(row)
    return rows


def format_demo_table(rows: list[dict], kinds: Sequence[str] = tuple(DEMO_MIX)) -> str:
    """Rows of `run_decode_demo` as a fixed-width table, an acceptance column per kind of ``kinds``."""
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    widths = {kind: max(6, len(kind)) for kind in kinds}
    head = (f"{'method':<10} {'tok/s':>8} {'vs hf':>7} {'vs ar':>7} {'accept':>7} "
            + "".join(f"{kind:>{widths[kind]}} " for kind in kinds) + f"{'tok/fwd':>8} {'exact':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        exact = "-" if r["exact_match"] is None else ("yes" if r["exact_match"] else "NO")
        lines.append(
            f"{r['method']:<10} {r['tokens_per_s']:>8.1f} {fmt(r['speedup'], '.2f'):>6}x "
            f"{fmt(r.get('speedup_vs_ar'), '.2f'):>6}x "
            f"{fmt(r['acceptance_rate'], '.3f'):>7} "
            + "".join(f"{fmt(r.get(f'acceptance_{kind}'), '.2f'):>{widths[kind]}} " for kind in kinds)
            + f"{r['mean_accepted_len']:>8.2f} {exact:>6}"
        )
    return "\n".join(lines)


def _model_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--model``: a model folder, or a registered model's name, pulled on first use (as the
    other commands' ``--model``: `specops.models.cli.MODEL_FOLDER`); the value as given."""
    from specops.models.cli import MODEL_FOLDER

    if value is not None:
        MODEL_FOLDER.convert(value, param, ctx)
    return value


@click.command("demo")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--gamma", type=int, default=4, show_default=True)
@click.option("--repeats", type=int, default=1, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--ops/--no-ops", default=True, show_default=True,
              help="After the decoding table, run specops serve + the controller on an embedded Redis.")
@click.option("--rounds", type=click.IntRange(min=1, max=100), default=8, show_default=True,
              help="Rounds of requests (one controller tick each) in the ops part.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=".specops/demo", show_default=True,
              envvar="SPECOPS_STATE_DIR", help="Where the embedded Redis keeps its data.")
@click.option("--model", callback=_model_option, default=None,
              help="A model folder, or a registered model's name, pulled on first use (`specops models list`): "
                   "the demo runs the methods it has without a draft model (ar, ngram, and eagle when "
                   "`specops train eagle --model NAME` cached a drafter), on prompts rendered with its chat "
                   "template, and serves it in the ops part [default: the bundled models].")
def demo_command(max_new_tokens, gamma, repeats, quiet, ops, rounds, state_dir, model):
    """Plain vs speculative decoding on the bundled models (or --model), then the ops loop on live traffic."""
    from specops.bench.decode import BenchError

    if max_new_tokens < 1 or gamma < 1 or repeats < 1:
        raise click.BadParameter("--max-new-tokens, --gamma and --repeats must be >= 1")
    if model is not None:
        _model_demo(model, max_new_tokens, gamma, repeats, quiet, ops, rounds, state_dir)
        return
    click.echo(f"specops demo: bundled target + draft + Medusa heads, {sum(DEMO_MIX.values())} prompts "
               f"({', '.join(f'{n} {k}' for k, n in DEMO_MIX.items())}), {max_new_tokens} new tokens each")
    try:
        rows = run_decode_demo(max_new_tokens=max_new_tokens, gamma=gamma, repeats=repeats, progress=not quiet)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_demo_table(rows))
    click.echo("vs hf: vs transformers generate(do_sample=False); vs ar: vs our own plain decoding; "
               "accept: accepted/drafted tokens; "
               "hot = temperature 1.0 sampling; exact: greedy output identical to transformers")
    if ops:
        _ops_part(rounds, state_dir)


def _model_demo(ref: str, max_new_tokens: int, gamma: int, repeats: int, quiet: bool, ops: bool, rounds: int,
                state_dir: str) -> None:
    """``specops demo --model``: the decoding table and the ops loop on that model."""
    from specops.bench.chat_suite import CREATIVE_TEMPERATURE
    from specops.bench.decode import BenchError

    try:
        dm = demo_model(ref, progress=not quiet)
        prompt_kind = "rendered with its chat template" if dm.chat else "completions (no chat template)"
        where = str(dm.folder) if dm.ref == str(dm.folder) else f"{dm.ref} ({dm.folder})"
        click.echo(f"specops demo: {where}, methods {', '.join(dm.methods)}; "
                   f"{len(dm.prompts)} prompts ({', '.join(f'{n} {k}' for k, n in dm.mix.items())}) {prompt_kind}, "
                   f"{max_new_tokens} new tokens each")
        click.echo(dm.eagle_note)
        rows = run_decode_demo(max_new_tokens=max_new_tokens, gamma=gamma, repeats=repeats, methods=dm.methods,
                               model=dm.ref, progress=not quiet, prompts=dm.prompts, kinds=tuple(dm.mix))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_demo_table(rows, kinds=tuple(dm.mix)))
    sampled = (f"creative = temperature {CREATIVE_TEMPERATURE:g} sampling" if dm.chat
               else "hot = temperature 1.0 sampling")
    click.echo("vs hf: vs transformers generate(do_sample=False); vs ar: vs our own plain decoding; "
               f"accept: accepted/drafted tokens; {sampled}; exact: greedy output identical to transformers")
    if ops:
        _ops_part(rounds, state_dir, model=dm)


def _ops_part(rounds: int, state_dir: str, model: DemoModel | None = None) -> None:
    """The control loop on live serving: `specops.demo_ops.run_ops_demo_http` (on ``model`` when given)."""
    from specops.demo_ops import BAD_CANARY_POLICY, DEFAULT_POLICY, format_http_round, run_ops_demo_http

    canary_round = min(2, rounds - 1)
    click.echo("")
    click.echo(f"ops: an embedded Redis in {state_dir}; {DEFAULT_POLICY.name} (durations x0.25) is revision 1; "
               "`specops serve` and `specops controller run` start as their own processes and requests go over HTTP")
    extra = {}
    if model is not None:
        spec = [m for m in model.methods if m in ("ngram", "eagle")]
        switched = "eagle" if "eagle" in spec else "ngram"
        click.echo(f"     `specops serve --model {model.ref}`: the policies' draft and Medusa classes run {switched} "
                   f"(this model has {' and '.join(spec)}); "
                   + ("chat requests" if model.chat else "completion requests"))
        extra = {"model": model.ref, "chat": model.chat, "methods": spec}
    click.echo(f"     before round {canary_round + 1} {BAD_CANARY_POLICY.name} is rolled out as a canary "
               "(n-gram with a long fixed gamma on hot prompts)")
    reports = run_ops_demo_http(state_dir=state_dir, rounds=rounds, canary_round=canary_round,
                                on_round=lambda r: click.echo(format_http_round(r)),
                                on_event=lambda e: click.echo(f"  >> {e}"), **extra)
    kinds = [e["kind"] for r in reports for e in r.events]
    reasons = " ".join(str(e.get("reason", "")) for r in reports for e in r.events)
    click.echo(f"controller: {reasons.count(':adapt')} adaptations, {reasons.count(':fallback_on')} fallbacks, "
               f"{kinds.count('rollout.analysis')} canary analyses, {kinds.count('rollout.rollback')} rollbacks; "
               f"{sum(r.errors for r in reports)} failed requests")
