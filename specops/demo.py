"""``specops demo``: the bundled models, plain vs speculative decoding, on mixed prompts.

`run_decode_demo` is the core (a list of table rows); `demo_command` prints it. The
prompts mix code, docstring prose and high-temperature sampling, so the table shows
what the mission says to expect: code accepts far more than prose, and hot sampling
accepts least.
"""

from __future__ import annotations

import click

DEMO_METHODS = ("hf-greedy", "ar", "draft", "ngram", "medusa", "auto")
DEMO_MIX = {"code": 3, "prose": 2, "hot": 2}   # prompts per kind


def demo_prompts(seed: int = 0) -> list:
    """A short mixed set from the built-in ``mixed`` suite (held-out stdlib tests)."""
    from specops.bench.suites import builtin_suite

    chosen, taken = [], {k: 0 for k in DEMO_MIX}
    for prompt in builtin_suite("mixed", seed=seed):
        if taken.get(prompt.kind, 0) < DEMO_MIX.get(prompt.kind, 0):
            chosen.append(prompt)
            taken[prompt.kind] += 1
    return chosen


def run_decode_demo(*, max_new_tokens: int = 64, gamma: int = 4, repeats: int = 1, methods=DEMO_METHODS,
                    model: str | None = None, draft: str | None = None, progress: bool = True,
                    seed: int = 0) -> list[dict]:
    """Decode the demo prompts with every method; one row per method: ``method``,
    ``tokens_per_s``, ``speedup`` (vs transformers' greedy ``generate``), ``speedup_vs_ar``
    (vs our own plain decoding),
    ``acceptance_rate``, ``mean_accepted_len``, ``exact_match`` and the acceptance
    per prompt kind (``acceptance_code`` / ``acceptance_prose`` / ``acceptance_hot``)."""
    from specops.bench.decode import BenchConfig, run_benchmark

    cfg = BenchConfig(suite="mixed", methods=list(methods), max_new_tokens=max_new_tokens, repeats=repeats,
                      gamma=gamma, model=model, draft=draft, progress=progress, seed=seed)
    report = run_benchmark(cfg, prompts=demo_prompts(seed))
    rows = []
    for r in report["results"]:
        row = {k: r[k] for k in ("method", "tokens_per_s", "speedup", "speedup_vs_ar", "acceptance_rate",
                                 "mean_accepted_len", "exact_match")}
        for kind in DEMO_MIX:
            row[f"acceptance_{kind}"] = r["by_kind"].get(kind, {}).get("acceptance_rate")
        rows.append(row)
    return rows


def format_demo_table(rows: list[dict]) -> str:
    """Rows of `run_decode_demo` as a fixed-width table."""
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    head = (f"{'method':<10} {'tok/s':>8} {'vs hf':>7} {'vs ar':>7} {'accept':>7} {'code':>6} {'prose':>6} "
            f"{'hot':>6} {'tok/fwd':>8} {'exact':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        exact = "-" if r["exact_match"] is None else ("yes" if r["exact_match"] else "NO")
        lines.append(
            f"{r['method']:<10} {r['tokens_per_s']:>8.1f} {fmt(r['speedup'], '.2f'):>6}x "
            f"{fmt(r.get('speedup_vs_ar'), '.2f'):>6}x "
            f"{fmt(r['acceptance_rate'], '.3f'):>7} {fmt(r['acceptance_code'], '.2f'):>6} "
            f"{fmt(r['acceptance_prose'], '.2f'):>6} {fmt(r['acceptance_hot'], '.2f'):>6} "
            f"{r['mean_accepted_len']:>8.2f} {exact:>6}"
        )
    return "\n".join(lines)


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
def demo_command(max_new_tokens, gamma, repeats, quiet, ops, rounds, state_dir):
    """Plain vs speculative decoding on the bundled models, then the ops loop on live traffic."""
    from specops.bench.decode import BenchError

    if max_new_tokens < 1 or gamma < 1 or repeats < 1:
        raise click.BadParameter("--max-new-tokens, --gamma and --repeats must be >= 1")
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


def _ops_part(rounds: int, state_dir: str) -> None:
    """The control loop on live serving: `specops.demo_ops.run_ops_demo_http`."""
    from specops.demo_ops import BAD_CANARY_POLICY, DEFAULT_POLICY, format_http_round, run_ops_demo_http

    canary_round = min(2, rounds - 1)
    click.echo("")
    click.echo(f"ops: an embedded Redis in {state_dir}; {DEFAULT_POLICY.name} (durations x0.25) is revision 1; "
               "`specops serve` and `specops controller run` start as their own processes and requests go over HTTP")
    click.echo(f"     before round {canary_round + 1} {BAD_CANARY_POLICY.name} is rolled out as a canary "
               "(n-gram with a long fixed gamma on hot prompts)")
    reports = run_ops_demo_http(state_dir=state_dir, rounds=rounds, canary_round=canary_round,
                                on_round=lambda r: click.echo(format_http_round(r)),
                                on_event=lambda e: click.echo(f"  >> {e}"))
    kinds = [e["kind"] for r in reports for e in r.events]
    reasons = " ".join(str(e.get("reason", "")) for r in reports for e in r.events)
    click.echo(f"controller: {reasons.count(':adapt')} adaptations, {reasons.count(':fallback_on')} fallbacks, "
               f"{kinds.count('rollout.analysis')} canary analyses, {kinds.count('rollout.rollback')} rollbacks; "
               f"{sum(r.errors for r in reports)} failed requests")
