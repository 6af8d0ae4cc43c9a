"""``specops bench sidecar --engine llamacpp``: per-class routing on llama-server pools against
speculating everywhere and nowhere.

Starts ``llama-server`` pools on one GGUF model (default: the bundled target, converted
once) with the flags ``specops engine-config --engine llamacpp`` renders from
`specops.bench.llamacpp_pools.POLICY` — speculative ones (n-gram drafting, ``--spec-type
ngram-simple``) and plain ones (``--spec-type none``), each with ``--threads`` and
``--parallel`` slots — and three ``specops sidecar --engine llamacpp``, all routing with
the policy in the state the controller's fallback leads to (``creative`` with
``method: off``, `llamacpp_pools.policy_text`): greedy ``code`` to the pool named ``spec``,
sampled ``creative`` to the pool named ``plain``. The three differ only in what those two
pools are, so each mode has the same processes, threads and routing:

* ``routed``    — ``spec`` speculates, ``plain`` does not (per-class speculation);
* ``all-spec``  — both pools speculate;
* ``all-plain`` — neither does.

(Four pools in all: two speculative, two plain, one thread each by default; only one mode's
two pools work at a time.) Per concurrency and repeat the same two-class mix of streamed
``/v1/completions`` (bench serve's ``code`` prompts greedy and ``hot`` prompts, the same
code text at temperature 1, half and half; ``ignore_eos``, so every request generates
``--max-tokens``) goes through each mode's sidecar, in an order rotated per repeat.

Per mode: overall tokens/s (all completion tokens / the cell's wall time) and per class the
mean of each request's own tokens/s (completion tokens / its end-to-end time), the median
over repeats. ``gain`` = routed / the better of all-spec and all-plain, overall (the goal:
≥ 1.1). The routed sidecar's own CPU per request and per content chunk is measured as in
the overhead bench (`sidecar_overhead._sidecar_cpu`: its CPU during the routed cell minus
its idle rate during the other modes' cells).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from specops.bench.llamacpp_build import binary_version
from specops.bench.llamacpp_pools import (
    Pool,
    PoolError,
    bundled_gguf,
    llama_server,
    pool_args,
    start_pool,
    write_policy,
)
from specops.bench.serve import BenchServeError, ServeBenchConfig, _free_port, _stop, _wait_ready, build_prompts
from specops.bench.sidecar_overhead import _content_chunks, _proc_cpu_s, _sidecar_cpu, _spawn
from specops.bench.serve.stats import median_known

MODES = ("routed", "all-spec", "all-plain")
GOAL = 1.1


@dataclass
class LlamaBenchConfig:
    model: str | None = None          # GGUF file; None: the bundled target converted
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    num_prompts: int | None = None    # per cell; None: max(8, 4 x concurrency)
    repeats: int = 2
    max_tokens: int = 64
    threads: int = 1                  # --threads of each pool
    parallel: int = 4                 # --parallel slots of each pool
    warmup: int = 4
    seed: int = 0
    server_args: list[str] = field(default_factory=list)  # appended to both pools' arguments
    progress: bool = True


def _classes(prompts: list[tuple[str, float]]) -> list[str]:
    return ["creative" if t >= 0.5 else "code" for _, t in prompts]


def cell_stats(results: list[Any], classes: list[str], wall_s: float) -> dict[str, Any]:
    """Overall and per-class throughput of one cell (requests in prompt order)."""
    ok = [(r, c) for r, c in zip(results, classes) if r.ok]
    tokens = sum(r.output_tokens for r, _ in ok)
    out: dict[str, Any] = {"requests": len(results), "errors": len(results) - len(ok), "tokens": tokens,
                           "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
                           "error_samples": sorted({r.error for r in results if not r.ok})[:3]}
    for name in sorted(set(classes)):
        rates = [r.output_tokens / r.e2e_s for r, c in ok if c == name and r.e2e_s > 0]
        out[f"{name}_tokens_per_s"] = statistics.mean(rates) if rates else None
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        mine = [r for r in runs if r["concurrency"] == c]
        row: dict[str, Any] = {"concurrency": c, "repeats": len(mine)}
        for mode in MODES:
            for key in ("tokens_per_s", "code_tokens_per_s", "creative_tokens_per_s"):
                row[f"{mode}_{key}"] = median_known([r[mode].get(key) for r in mine])
            row[f"{mode}_errors"] = sum(r[mode]["errors"] for r in mine)
        best = max((row[f"{m}_tokens_per_s"] or 0.0) for m in ("all-spec", "all-plain"))
        row["gain"] = row["routed_tokens_per_s"] / best if best and row["routed_tokens_per_s"] else None
        gains = []
        for r in mine:
            other = max(r["all-spec"]["tokens_per_s"] or 0.0, r["all-plain"]["tokens_per_s"] or 0.0)
            gains.append(r["routed"]["tokens_per_s"] / other if other and r["routed"]["tokens_per_s"] else None)
        row["gain_runs"] = gains
        row["meets_goal"] = None if row["gain"] is None else row["gain"] >= GOAL
        for key in ("cpu_ms_per_request", "cpu_ms_per_chunk"):
            row[f"sidecar_{key}"] = median_known([r.get("sidecar_cpu", {}).get(key) for r in mine])
        rows.append(row)
    return rows


def run_llamacpp_bench(cfg: LlamaBenchConfig) -> dict[str, Any]:
    """Start the pools and the sidecar, measure the three modes, stop everything."""
    from specops.bench.serve import run_cell

    if cfg.repeats < 1 or cfg.threads < 1 or cfg.parallel < 1:
        raise BenchServeError("--repeats, --threads and --parallel must be >= 1")
    try:
        model = Path(cfg.model) if cfg.model else bundled_gguf()
    except (ImportError, ValueError, OSError) as exc:
        raise BenchServeError(f"no GGUF model: {exc} (pass --model FILE.gguf, or pip install gguf)") from None
    if not model.is_file():
        raise BenchServeError(f"--model {model}: no such file")
    workdir = Path(tempfile.mkdtemp(prefix="specops-bench-llamacpp-"))
    pools: dict[str, Pool] = {}
    sidecars: dict[str, Any] = {}
    try:
        policy = write_policy(workdir / "policy.yaml")
        routed_policy = write_policy(workdir / "routed.yaml", routed=True)
        for name in ("spec-a", "spec-b", "plain-a", "plain-b"):
            args = pool_args(policy, name.split("-")[0], cfg.threads, cfg.parallel) + list(cfg.server_args)
            pools[name] = start_pool(name, model, _free_port(), args, workdir)
        layout = {"routed": ("spec-a", "plain-a"), "all-spec": ("spec-a", "spec-b"),
                  "all-plain": ("plain-a", "plain-b")}
        urls = {}
        for mode, (spec_pool, plain_pool) in layout.items():
            sport = _free_port()
            sidecars[mode] = _spawn(["sidecar", "--engine", "llamacpp", "--upstream", f"spec={pools[spec_pool].url}",
                                     "--upstream", f"plain={pools[plain_pool].url}", "--policy", str(routed_policy),
                                     "--listen", f"127.0.0.1:{sport}", "--log-level", "warning"], workdir,
                                    f"sidecar-{mode}")
            urls[mode] = f"http://127.0.0.1:{sport}"
        for mode, url in urls.items():
            _wait_ready(url, 60, sidecars[mode])
        side = sidecars["routed"]
        scfg = ServeBenchConfig(max_tokens=cfg.max_tokens, seed=cfg.seed, mix={"code": 0.5, "hot": 0.5},
                                progress=False)
        counts = {c: cfg.num_prompts or max(8, 4 * c) for c in cfg.concurrency}
        drawn = build_prompts(scfg, max([*counts.values(), cfg.warmup, 1]))
        warm = drawn[:max(cfg.warmup, 1)]
        for url in urls.values():
            asyncio.run(run_cell(url, "model", warm, min(len(warm), max(cfg.concurrency)), scfg))
        runs = []
        total = cfg.repeats * len(cfg.concurrency)
        bar = click.progressbar(length=total, label="bench sidecar (llama.cpp)", file=sys.stderr) \
            if cfg.progress else None
        try:
            for rep in range(cfg.repeats):
                for i, c in enumerate(cfg.concurrency):
                    prompts = drawn[:counts[c]]
                    classes = _classes(prompts)
                    shift = (rep + i) % len(MODES)
                    order = list(MODES[shift:] + MODES[:shift])
                    out: dict[str, Any] = {"repeat": rep, "concurrency": c, "order": order}
                    direct_cpu = direct_wall = 0.0
                    for mode in order:
                        cpu0 = _proc_cpu_s(side.pid)
                        results, wall = asyncio.run(run_cell(urls[mode], "model", prompts, c, scfg))
                        cpu1 = _proc_cpu_s(side.pid)
                        out[mode] = cell_stats(results, classes, wall)
                        cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
                        if mode == "routed":
                            out["_via"] = {"_cpu_s": cpu, "_wall_s": wall, "requests": len(results),
                                           "_chunks": _content_chunks(results)}
                        elif cpu is not None:
                            direct_cpu += cpu
                            direct_wall += wall
                    out["sidecar_cpu"] = _sidecar_cpu({"_cpu_s": direct_cpu if direct_wall else None,
                                                       "_wall_s": direct_wall}, out.pop("_via"))
                    runs.append(out)
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.render_finish()
        binary = llama_server()
        return {"config": asdict(cfg), "engine": "llamacpp", "model_file": str(model),
                "llama_server": binary, "llama_version": binary_version(binary).splitlines()[0],
                "pool_args": {name: pool_args(policy, name, cfg.threads, cfg.parallel) + list(cfg.server_args)
                              for name in ("spec", "plain")},
                "layout": {mode: list(names) for mode, names in layout.items()},
                "goal": GOAL, "runs": runs, "results": summarize(runs), "load_average": list(os.getloadavg()),
                "cpu_count": os.cpu_count(), "at": time.time()}
    except PoolError as exc:
        raise BenchServeError(str(exc)) from None
    finally:
        for proc in sidecars.values():
            _stop(proc)
        for pool in pools.values():
            pool.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'conc':>5} {'mode':<10}{'tok/s':>9}{'code tok/s':>12}{'creative tok/s':>16}{'errors':>8}   "
             f"(median of {report['config']['repeats']} repeats; per class: mean of each request's tokens/s)"]
    for r in report["results"]:
        for j, mode in enumerate(MODES):
            lines.append(f"{r['concurrency'] if j == 0 else '':>5} {mode:<10}{_f(r[f'{mode}_tokens_per_s']):>9}"
                         f"{_f(r[f'{mode}_code_tokens_per_s']):>12}{_f(r[f'{mode}_creative_tokens_per_s']):>16}"
                         f"{r[f'{mode}_errors']:>8}")
        runs = ", ".join(_f(g, ".2f") for g in r["gain_runs"])
        lines.append(f"{'':>5} routed / better of all-spec, all-plain: {_f(r['gain'], '.2f')}x (runs: {runs}; "
                     f"goal >= {GOAL}: {r['meets_goal']})")
        if r.get("sidecar_cpu_ms_per_request") is not None:
            lines.append(f"{'':>5} sidecar CPU: {r['sidecar_cpu_ms_per_request']:.3f} ms per request, "
                         f"{r['sidecar_cpu_ms_per_chunk'] or 0:.3f} ms per content chunk")
    lines.append(f"pools: {report['llama_version']}; spec {' '.join(report['pool_args']['spec'])}; "
                 f"plain {' '.join(report['pool_args']['plain'])}")
    if report.get("layout"):
        lines.append("code -> pool 'spec', creative -> pool 'plain', in: " + "; ".join(
            f"{mode} {spec} + {plain}" for mode, (spec, plain) in report["layout"].items()))
    if report.get("model_file"):
        lines.append(f"model: {report['model_file']}")
    lines.append(f"load average during the run: {', '.join(f'{x:.2f}' for x in report['load_average'])} "
                 f"({report['cpu_count']} CPUs)")
    return "\n".join(lines)
