"""``specops bench speedup-truth``: the telemetry's speed-up against the client's ground truth.

The speed-up the dashboards, the alert rules and the controller's fallback rules read is
an estimate: ``Σ plain_s_estimate / Σ wall_s``, the server's guess at what plain decoding
would have taken (see docs/telemetry.md). This bench checks that guess where it can be
checked directly. It starts ``specops serve`` (bundled models, or ``--model NAME|PATH`` as the
target alone, with n-gram drafting; its own embedded Redis) with
one request class, ``truth``, whose method is set per cell through Redis, as an operator
(or the controller's fallback) sets it:

``plain``   the class forced to plain decoding (its effective method ``off``);
``spec``    the class speculating with the policy's method and γ (``--method``, ``--gamma``)
            as served: the engine's planner drafts fewer tokens, down to none, where more
            would not pay (on a loaded 2-core host it declines most steps);
``forced``  every request of the class speculating as set: the class is marked fallen back
            with a probe fraction of 1, so every request is a probe, which the planner
            drafts for whatever its cost model predicts (`SpecSettings.observed`).

For each concurrency, each repeat runs one cell of every mode back to back (the order
rotated between repeats), on the same prompts behind a fresh tag line (so no cell
finds another's prompts in the prefix cache). A cell first sends a settle batch of
unmeasured requests in its mode, then its measured requests from ``concurrency`` closed-loop
clients. Per cell:

* the client's output tokens/s (tokens / the cell's wall time);
* the telemetry's speed-up of the cell's requests: the difference of the server's
  ``specops_plain_decode_seconds_estimate_total`` over the difference of
  ``specops_decode_seconds_total`` for the class, scraped before and after the cell (the
  Prometheus ``speedup`` series over exactly that cell).

Ground truth per repeat = a mode's tokens/s / the plain tokens/s of the same repeat; the
table gives, per speculating mode, the median over repeats with the range, beside the
telemetry's median (range) and the per-repeat error of the telemetry against the truth, and
the telemetry of the plain cells (which must read 1.0).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

CLASS = "truth"
METHODS = ("draft", "ngram", "medusa")
PLAIN_METRIC = "specops_plain_decode_seconds_estimate"
WALL_METRIC = "specops_decode_seconds"
TOKENS_METRIC = "specops_generated_tokens"
SPEC_MODES = ("spec", "forced")
MODES = ("plain", *SPEC_MODES)


class TruthError(RuntimeError):
    """A configuration or server problem (one readable line)."""


@dataclass
class TruthConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 16])
    repeats: int = 3
    method: str = "draft"
    gamma: int = 4
    max_tokens: int = 48
    requests: int | None = None      # per measured cell; None: `cell_requests`
    settle: int | None = None        # unmeasured requests before each cell; None: the concurrency
    mix: dict[str, float] = field(default_factory=lambda: {"code": 1.0})
    seed: int = 0
    threads: int | None = None       # the server's --threads
    model: str | None = None         # the server's --model (None: the bundled models)
    progress: bool = True

    def validate(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise TruthError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.repeats < 1:
            raise TruthError(f"repeats must be >= 1, got {self.repeats}")
        if self.method not in METHODS:
            raise TruthError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.gamma <= 16:
            raise TruthError(f"gamma must be in 1..16, got {self.gamma}")
        if self.max_tokens < 2:
            raise TruthError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if self.requests is not None and self.requests < 1:
            raise TruthError(f"requests must be >= 1, got {self.requests}")
        if self.settle is not None and self.settle < 0:
            raise TruthError(f"settle must be >= 0, got {self.settle}")
        if self.model is not None and self.method != "ngram":
            raise TruthError(f"--model serves the target alone (no draft model or Medusa heads): method "
                             f"{self.method!r} needs them; use --method ngram")

    def cell_requests(self, concurrency: int) -> int:
        """Measured requests of a cell: ``requests``, else 8 rounds of the concurrency (at least 32: at
        concurrency 1, 16 requests were a 2 s cell and its repeats spread by a third on a loaded host)."""
        return self.requests if self.requests is not None else max(32, 8 * concurrency)


def policy_text(cfg: TruthConfig) -> str:
    """The bench's policy: one class, ``truth``, speculating with ``cfg.method`` as set (no controller runs)."""
    knob = (f"medusa_heads: {{initial: {min(cfg.gamma, 4)}, min: 1, max: 4}}" if cfg.method == "medusa"
            else f"gamma: {{initial: {cfg.gamma}, min: 1, max: {max(cfg.gamma, 8)}}}")
    return (f'version: "speedup-truth-1"\ndescription: one class, forced plain or speculative per cell\n'
            f"default_class: {CLASS}\nclasses:\n  - name: {CLASS}\n    method: {cfg.method}\n"
            f"    {knob}\n    adaptation: {{mode: fixed}}\n")


def class_counters(text: str, klass: str = CLASS) -> dict[str, float]:
    """The class's plain-time estimate, decode seconds and tokens from a ``/metrics`` page (summed over
    the ``method`` label: a cell's requests are labelled with the method they decoded with)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {PLAIN_METRIC: 0.0, WALL_METRIC: 0.0, TOKENS_METRIC: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for sample in family.samples:
            if sample.name == family.name + "_total" and sample.labels.get("class") == klass:
                out[family.name] += sample.value
    return out


def telemetry_speedup(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The ``speedup`` series over one cell: Δ plain-time estimate / Δ decode seconds."""
    wall = after[WALL_METRIC] - before[WALL_METRIC]
    if wall <= 0:
        return None
    return (after[PLAIN_METRIC] - before[PLAIN_METRIC]) / wall


def _scrape(url: str) -> dict[str, float]:
    import httpx

    r = httpx.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return class_counters(r.text)


def _stat(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(cells: list[dict[str, Any]], concurrency: list[int],
              modes: tuple[str, ...] = SPEC_MODES) -> list[dict[str, Any]]:
    """Per concurrency and speculating mode: the ground truth (the mode's client tokens/s over the plain
    cell's of the same repeat), the telemetry's speed-up of the mode's cells and its relative error against
    that truth (per repeat), and the telemetry of the plain cells; each as median and (min, max)."""
    rows = []
    for c in concurrency:
        by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
        for cell in cells:
            if cell["concurrency"] == c:
                by_repeat.setdefault(cell["repeat"], {})[cell["mode"]] = cell
        plain = [r["plain"] for r in by_repeat.values() if "plain" in r]
        plain_tel = [p["telemetry_speedup"] for p in plain if p["telemetry_speedup"] is not None]
        for mode in modes:
            pairs = [(r["plain"], r[mode]) for r in by_repeat.values()
                     if "plain" in r and mode in r and r["plain"]["tokens_per_s"] > 0]
            truth = [m["tokens_per_s"] / p["tokens_per_s"] for p, m in pairs]
            tel = [m["telemetry_speedup"] for _, m in pairs]
            rows.append({
                "concurrency": c, "mode": mode, "repeats": len(pairs),
                "plain_tokens_per_s": _stat([p["tokens_per_s"] for p, _ in pairs]),
                "tokens_per_s": _stat([m["tokens_per_s"] for _, m in pairs]),
                "truth_speedup": _stat(truth),
                "telemetry_speedup": _stat([t for t in tel if t is not None]),
                "relative_error": _stat([t / g - 1.0 for t, g in zip(tel, truth) if t is not None and g > 0]),
                "telemetry_speedup_plain": _stat(plain_tel),
                "spec_step_share": _stat([m["spec_step_share"] for _, m in pairs
                                          if m.get("spec_step_share") is not None]),
            })
    return rows


def _fmt(s: dict[str, float] | None, digits: int = 2, pct: bool = False) -> str:
    if s is None:
        return "-"
    if pct:
        return f"{s['median'] * 100:+.0f}% ({s['min'] * 100:+.0f}..{s['max'] * 100:+.0f})"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"speed-up truth on {report.get('model', 'bundled')}: class {CLASS} {cfg['method']} γ{cfg['gamma']} "
             "vs forced plain, "
             f"{cfg['max_tokens']} tokens/request, {cfg['repeats']} interleaved repeats "
             "(median (min-max) over repeats)",
             f"{'conc':>4}  {'mode':<6}  {'plain tok/s':>16}  {'tok/s':>16}  {'truth':>16}  "
             f"{'telemetry':>16}  {'error':>15}  {'plain telemetry':>16}  {'spec steps':>16}"]
    for r in report["results"]:
        lines.append(f"{r['concurrency']:>4}  {r['mode']:<6}  {_fmt(r['plain_tokens_per_s'], 0):>16}  "
                     f"{_fmt(r['tokens_per_s'], 0):>16}  {_fmt(r['truth_speedup']):>16}  "
                     f"{_fmt(r['telemetry_speedup']):>16}  {_fmt(r['relative_error'], pct=True):>15}  "
                     f"{_fmt(r['telemetry_speedup_plain']):>16}  {_fmt(r['spec_step_share']):>16}")
    return "\n".join(lines)


def cell_order(repeat: int, index: int) -> list[str]:
    """The modes' order in repeat ``repeat`` at the ``index``-th concurrency: rotated by both, and
    reversed every other repeat, so each mode runs first, last and behind each other one alike."""
    k = (repeat + index) % len(MODES)
    row = list(MODES[k:] + MODES[:k])
    return row[::-1] if repeat % 2 else row


def run_truth(cfg: TruthConfig) -> dict[str, Any]:
    """Start the server, run every (concurrency, repeat, mode) cell, return ``{"config", "cells", "results"}``."""
    from dataclasses import replace

    import redis as redis_lib

    from specops.bench import serve as sb
    from specops.policies.redis_backend import close, connect
    from specops.policies.rollout import effective_for
    from specops.policies.store import PolicyStore

    cfg.validate()
    workdir = Path(tempfile.mkdtemp(prefix="specops-bench-truth-"))
    (workdir / "policy.yaml").write_text(policy_text(cfg))
    embedded = client = proc = None
    bar = None
    try:
        embedded = connect(None, workdir / "redis")
        redis_url = f"unix://{embedded.socket_file}"
        client = redis_lib.Redis.from_url(redis_url)
        args = ["--policy", str(workdir / "policy.yaml"), "--reconcile-s", "0.5"]
        if cfg.threads is not None:
            args += ["--threads", str(cfg.threads)]
        if cfg.model is not None:
            from specops.models.resolve import resolve_model

            args += ["--model", str(Path(resolve_model(cfg.model, progress=cfg.progress)).resolve())]
        scfg = sb.ServeBenchConfig(max_tokens=cfg.max_tokens, mix=cfg.mix, seed=cfg.seed, server_args=args)
        proc, url = sb._start_server(scfg, redis_url, workdir, max(cfg.concurrency))
        sb._wait_ready(url, 600, proc)
        store = PolicyStore(client)
        rev = store.current_revision()
        if rev is None:
            raise TruthError("the server stored no policy revision")
        spec = effective_for(store.get_revision(rev).policy, rev, time.time())
        settings = {"spec": spec, "plain": {k: replace(v, method="off") for k, v in spec.items()},
                    "forced": {k: replace(v, fallback_active=True, probe_fraction=1.0) for k, v in spec.items()}}
        model = sb._wait_ready(url, 60).get("model", "bundled")
        tags = sb.PromptTags(False)

        def set_mode(mode: str) -> None:
            store.set_effective(settings[mode], epoch=None, reason=f"bench speedup-truth: {mode}", replace=True,
                                actor="bench")
            sb._wait_settings(url, sb._expected(settings[mode]))

        # warm-up: every mode at the largest concurrency
        for mode in MODES:
            set_mode(mode)
            c = max(cfg.concurrency)
            asyncio.run(sb.run_cell(url, model, tags.fresh(sb.build_prompts(scfg, 2 * c)), c, scfg))
        total = sum(cfg.cell_requests(c) for c in cfg.concurrency) * len(MODES) * cfg.repeats
        bar = click.progressbar(length=total, label="speedup-truth", file=sys.stderr) if cfg.progress else None
        on_done = (lambda: bar.update(1)) if bar else None
        cells = []
        for r in range(cfg.repeats):
            for j, c in enumerate(cfg.concurrency):
                prompts = sb.build_prompts(replace(scfg, seed=cfg.seed + 1000 * r + j), cfg.cell_requests(c))
                for mode in cell_order(r, j):
                    set_mode(mode)
                    settle = c if cfg.settle is None else cfg.settle
                    if settle:
                        asyncio.run(sb.run_cell(url, model, tags.fresh(prompts[:settle]), c, scfg))
                    before, planner0 = _scrape(url), sb.planner_counts(url)
                    results, duration = asyncio.run(sb.run_cell(url, model, tags.fresh(prompts), c, scfg,
                                                                on_done=on_done))
                    after, planner1 = _scrape(url), sb.planner_counts(url)
                    failed = [x.error for x in results if not x.ok]
                    if failed:
                        raise TruthError(f"{len(failed)} requests failed at concurrency {c}: {failed[0]}")
                    tokens = sum(x.output_tokens for x in results)
                    cells.append({"repeat": r, "concurrency": c, "mode": mode, "requests": len(results),
                                  "tokens": tokens, "duration_s": duration,
                                  "tokens_per_s": tokens / duration if duration > 0 else 0.0,
                                  "telemetry_speedup": telemetry_speedup(before, after),
                                  "telemetry_tokens": after[TOKENS_METRIC] - before[TOKENS_METRIC],
                                  "spec_step_share": sb.planner_delta(planner0, planner1)["spec_step_share"]})
        out_cfg = asdict(cfg)
        return {"config": out_cfg, "model": model, "cells": cells, "results": summarize(cells, cfg.concurrency)}
    finally:
        if bar is not None:
            bar.render_finish()
        if proc is not None:
            sb._stop(proc)
        if client is not None:
            client.close()
        if embedded is not None:
            embedded.connection_pool.disconnect()
            close(embedded)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"want comma-separated integers, got {text!r}") from None
    if not values:
        raise click.BadParameter("want at least one value")
    return values


@click.command("speedup-truth")
@click.option("--concurrency", default="1,2,4,16", show_default=True, help="Comma-separated concurrency levels.")
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Interleaved plain / spec pairs per concurrency.")
@click.option("--method", type=click.Choice(METHODS), default="draft", show_default=True)
@click.option("--gamma", type=click.IntRange(1, 16), default=4, show_default=True,
              help="γ (Medusa: heads, at most 4).")
@click.option("--max-tokens", type=click.IntRange(2, 4096), default=48, show_default=True)
@click.option("--requests", type=click.IntRange(1, 100_000), default=None,
              help="Measured requests per cell (default: 8 x concurrency, at least 32).")
@click.option("--settle", type=click.IntRange(0, 100_000), default=None,
              help="Unmeasured requests before each cell (default: the concurrency).")
@click.option("--mix", default="code:1", show_default=True, help="Prompt mix, as `bench serve --mix`.")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="The server's --threads.")
@click.option("--model", default=None,
              help="The server's target: a folder or a registered model's name, pulled on first use (`specops "
                   "models list`); served alone, so --method ngram. Default: the bundled models.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_speedup_truth_command(concurrency, repeats, method, gamma, max_tokens, requests, settle, mix, threads,
                                model, seed, json_path, quiet):
    """Check the telemetry's speed-up against client tokens/s, class forced plain vs speculative."""
    from specops.bench.serve import BenchServeError, parse_mix

    try:
        cfg = TruthConfig(concurrency=_int_list(concurrency), repeats=repeats, method=method, gamma=gamma,
                          max_tokens=max_tokens, requests=requests, settle=settle, mix=parse_mix(mix),
                          seed=seed, threads=threads, model=model, progress=not quiet)
        report = run_truth(cfg)
    except (TruthError, BenchServeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_table(report))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2, default=lambda v: None if math.isnan(v) else v) + "\n")
        click.echo(f"wrote {json_path}")
