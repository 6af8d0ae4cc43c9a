"""``specops bench sidecar``: what the sidecar adds to a stream, against the same engine directly.

The proxy's budget: ≤ 2 ms p50 and ≤ 5 ms p99 added to time to first
token, ≤ 0.5 ms p50 per streamed chunk, at concurrency 1 and 16. This starts (or takes,
``--base-url``) a ``specops serve`` engine and starts a ``specops sidecar`` in front of
it (one pool, no Redis: routing from the policy file), then runs the *same* streamed
``/v1/completions`` requests (the `specops.bench.serve` load generator and prompt mix)
directly and through the sidecar, one cell after the other, alternating which goes
first in each repeat (so drift in the engine or the machine's load falls on both).

Per repeat × concurrency it takes the p50 / p99 of TTFT and the p50 of ITL (gap between
content chunks) and TPOT ((E2E − TTFT) / (tokens − 1)) on each path; the report is the
median over repeats of each path's figure and of the difference (via sidecar − direct),
with the differences' spread beside it: the smallest and largest per-repeat difference
(table row ``spread``; every repeat's in the JSON, ``overhead_<figure>_runs``). A budget
verdict whose spread straddles the limit — or zero — is not a measurement of the proxy.

The sidecar's own CPU time
--------------------------
Latency differences between two runs of one engine on a shared machine carry the
engine's step jitter; the CPU time of the sidecar process depends far less on what else
runs. So each cell also reads the sidecar's CPU time (its threads' run time from
``/proc/<pid>/task/*/schedstat``, in ns; Linux only, else absent) before and after:
during a *direct* cell the sidecar is idle (its background loop: policy poll, engine
scrape), which gives its idle rate; during a *via sidecar* cell it relays, and
``CPU − idle rate × wall`` is the relaying's CPU. The report gives it per request and
per content chunk (``cpu_ms_per_request``, ``cpu_ms_per_chunk``: all of it divided by
the chunks, the per-request work included, so an upper bound of what one chunk costs).
That is the proxy's own work; what it adds to a latency is that plus any wait for a
core (on a busy machine, the wake-up of an idle process costs more CPU too: cold caches).

``--plain``
-----------
Starts the engine with ``examples/policies/off.yaml`` (no speculation: its step times
vary less, so the two paths' figures are closer to the proxy's own cost). The sidecar
keeps the ``--policy`` it was given (its routing work per request is unchanged): the
same engine, the same prompts, direct and through the sidecar, as without the flag.

Reading the figures: a delay the proxy adds *equally* to every chunk shifts the whole
stream, so it shows in TTFT and cancels out of ITL / TPOT; the per-chunk rows show
what the relay adds beyond that (chunks queued behind the proxy's own work, e.g. at
concurrency 16 when the proxy competes with the engine for CPU). Differences between
two runs of the same engine have noise of the engine's own step-time jitter: more
``--repeats`` and ``--num-prompts`` narrow it; a loaded machine widens it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from specops.bench.serve import (
    BenchServeError,
    ServeBenchConfig,
    _free_port,
    _percentile,
    _stop,
    _wait_ready,
    build_prompts,
    emit_report,
    run_cell,
)
from specops.bench.serve.stats import median_known

ROOT_POLICY = Path(__file__).resolve().parents[2] / "examples" / "policies" / "default.yaml"
OFF_POLICY = ROOT_POLICY.with_name("off.yaml")
BUDGET = {"ttft_p50_ms": 2.0, "ttft_p99_ms": 5.0, "chunk_p50_ms": 0.5}


@dataclass
class OverheadConfig:
    base_url: str | None = None
    engine: str = "specops"
    policy: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 16])
    num_prompts: int | None = None     # per cell; None: max(16, 4 x concurrency)
    repeats: int = 3
    max_tokens: int = 32
    warmup: int = 4
    prompts_file: str | None = None    # JSONL / one prompt per line; None: the serve bench's built-in mix
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    plain: bool = False                # start the engine with examples/policies/off.yaml
    progress: bool = True


def _cell_stats(results: list[Any]) -> dict[str, float | None]:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl_s]

    def pct(values: list[float], q: float) -> float | None:
        v = _percentile(values, q)
        return None if v is None else v * ms

    return {"requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50_ms": pct([r.ttft_s for r in ok], 0.5), "ttft_p99_ms": pct([r.ttft_s for r in ok], 0.99),
            "itl_p50_ms": pct(itls, 0.5), "tpot_p50_ms": pct(tpots, 0.5)}


def _proc_cpu_s(pid: int) -> float | None:
    """CPU time of a process in seconds (None where /proc cannot tell).

    The run time of its threads from ``/proc/<pid>/task/*/schedstat`` (nanoseconds), else
    ``utime + stime`` from ``/proc/<pid>/stat`` (clock ticks, usually 10 ms: too coarse
    for a cell of a few dozen requests).
    """
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        if total > 0:
            return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _content_chunks(results: list[Any]) -> int:
    return sum(1 + len(r.itl_s) for r in results if r.ok and r.ttft_s is not None)


def _sidecar_cpu(direct: dict[str, Any], via: dict[str, Any]) -> dict[str, float | None]:
    """The sidecar's relaying CPU in one repeat (see the module docstring)."""
    if direct.get("_cpu_s") is None or via.get("_cpu_s") is None or not direct["_wall_s"]:
        return {"cpu_ms_per_request": None, "cpu_ms_per_chunk": None}
    idle_rate = direct["_cpu_s"] / direct["_wall_s"]
    cpu = max(0.0, via["_cpu_s"] - idle_rate * via["_wall_s"])
    return {"cpu_ms_per_request": 1000 * cpu / via["requests"] if via["requests"] else None,
            "cpu_ms_per_chunk": 1000 * cpu / via["_chunks"] if via["_chunks"] else None,
            "cpu_idle_ms_per_s": 1000 * idle_rate}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats, per concurrency, of each path's figures and of the differences."""
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        mine = [r for r in runs if r["concurrency"] == c]
        row: dict[str, Any] = {"concurrency": c, "repeats": len(mine),
                               "errors": sum(r["direct"]["errors"] + r["sidecar"]["errors"] for r in mine)}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms"):
            row[f"direct_{key}"] = median_known([r["direct"][key] for r in mine])
            row[f"sidecar_{key}"] = median_known([r["sidecar"][key] for r in mine])
            diffs = [None if r["direct"][key] is None or r["sidecar"][key] is None
                     else r["sidecar"][key] - r["direct"][key] for r in mine]
            row[f"overhead_{key}"] = median_known(diffs)
            known = [d for d in diffs if d is not None]
            row[f"overhead_{key}_min"] = min(known) if known else None
            row[f"overhead_{key}_max"] = max(known) if known else None
            row[f"overhead_{key}_runs"] = diffs
        for key in ("cpu_ms_per_request", "cpu_ms_per_chunk"):
            row[f"sidecar_{key}"] = median_known([r.get("sidecar_cpu", {}).get(key) for r in mine])
        row["within_budget"] = {
            "ttft_p50": _le(row["overhead_ttft_p50_ms"], BUDGET["ttft_p50_ms"]),
            "ttft_p99": _le(row["overhead_ttft_p99_ms"], BUDGET["ttft_p99_ms"]),
            "chunk_p50": _le(row["overhead_itl_p50_ms"], BUDGET["chunk_p50_ms"]),
        }
        rows.append(row)
    return rows


def _le(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _spawn(argv: list[str], workdir: Path, name: str) -> subprocess.Popen:
    log = open(workdir / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "specops.cli", *argv], cwd=workdir, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc.log_path = workdir / f"{name}.log"  # type: ignore[attr-defined]  # read by _wait_ready on failure
    return proc


def run_overhead(cfg: OverheadConfig) -> dict[str, Any]:
    """Start what is needed, measure, stop it all; returns ``{"config", "budget", "runs", "results"}``."""
    if cfg.repeats < 1:
        raise BenchServeError("--repeats must be >= 1")
    policy = cfg.policy or str(ROOT_POLICY)
    if cfg.plain and cfg.base_url is not None:
        raise BenchServeError("--plain starts the engine with an off policy; with --base-url start yours with "
                              f"--policy {OFF_POLICY} instead")
    workdir = Path(tempfile.mkdtemp(prefix="specops-bench-sidecar-"))
    server = side = None
    try:
        direct = cfg.base_url
        if direct is None:
            port = _free_port()
            server = _spawn(["serve", "--port", str(port), "--policy", str(OFF_POLICY) if cfg.plain else policy,
                             "--max-batch",
                             str(max(cfg.concurrency)), "--log-level", "warning", *cfg.server_args], workdir, "serve")
            direct = f"http://127.0.0.1:{port}"
            _wait_ready(direct, 600, server)
        direct = direct.rstrip("/")
        sport = _free_port()
        side = _spawn(["sidecar", "--engine", cfg.engine, "--upstream", f"spec={direct}", "--policy", policy,
                       "--listen", f"127.0.0.1:{sport}", "--log-level", "warning"], workdir, "sidecar")
        via = f"http://127.0.0.1:{sport}"
        _wait_ready(via, 60, side)
        model = _wait_ready(direct, 60).get("model", "bundled")
        scfg = ServeBenchConfig(max_tokens=cfg.max_tokens, seed=cfg.seed, prompts_file=cfg.prompts_file,
                                progress=False)
        counts = {c: cfg.num_prompts or max(16, 4 * c) for c in cfg.concurrency}
        drawn = build_prompts(scfg, max([*counts.values(), cfg.warmup, 1]))  # once: building the mix is slow
        warm = drawn[:max(cfg.warmup, 1)]
        for url in (direct, via):
            asyncio.run(run_cell(url, model, warm, min(len(warm), max(cfg.concurrency)), scfg))
        runs = []
        total = cfg.repeats * len(cfg.concurrency)
        bar = click.progressbar(length=total, label="bench sidecar", file=sys.stderr) if cfg.progress else None
        try:
            for rep in range(cfg.repeats):
                for c in cfg.concurrency:
                    prompts = drawn[:counts[c]]
                    order = [("direct", direct), ("sidecar", via)]
                    if rep % 2:
                        order.reverse()
                    out: dict[str, Any] = {"repeat": rep, "concurrency": c, "first": order[0][0]}
                    for name, url in order:
                        cpu0 = _proc_cpu_s(side.pid)
                        results, wall = asyncio.run(run_cell(url, model, prompts, c, scfg))
                        cpu1 = _proc_cpu_s(side.pid)
                        out[name] = _cell_stats(results)
                        out[name].update(_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0, _wall_s=wall,
                                         _chunks=_content_chunks(results))
                    out["sidecar_cpu"] = _sidecar_cpu(out["direct"], out["sidecar"])
                    for name in ("direct", "sidecar"):
                        out[name] = {k.lstrip("_"): v for k, v in out[name].items()}
                    runs.append(out)
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.render_finish()
        return {"config": asdict(cfg), "model": model, "direct_url": direct, "sidecar_url": via,
                "budget_ms": BUDGET, "runs": runs,
                "results": summarize(runs), "load_average": list(os.getloadavg()), "at": time.time()}
    finally:
        if side is not None:
            _stop(side)
        if server is not None:
            _stop(server)


def _cells(values: list[float | None], widths: tuple[int, ...], signed: bool) -> str:
    return "".join(f"{('-' if v is None else (f'{v:+.2f}' if signed else f'{v:.2f}')):>{w}}"
                   for v, w in zip(values, widths))


def format_table(report: dict[str, Any]) -> str:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms")
    widths = (16, 16, 16, 16)
    lines = [f"{'conc':>5}{'':3}{'TTFT p50':>16}{'p99':>16}{'ITL p50':>16}{'TPOT p50':>16}   (ms; median of "
             f"{report['config']['repeats']} repeats)"]
    for r in report["results"]:
        for label in ("direct", "sidecar", "overhead"):
            values = [r[f"{label}_{k}"] for k in keys]
            lines.append(f"{r['concurrency'] if label == 'direct' else '':>5}   "
                         f"{_cells(values, widths, label == 'overhead')}   {label}")
        spread = "".join(f"{_spread(r[f'overhead_{k}_min'], r[f'overhead_{k}_max']):>{w}}"
                         for k, w in zip(keys, widths))
        lines.append(f"{'':>5}   {spread}   spread (min..max of the per-repeat differences)")
        ok = r["within_budget"]
        lines.append(f"{'':>5}   budget (+2 / +5 / +0.5 ms): TTFT p50 {ok['ttft_p50']}, p99 {ok['ttft_p99']}, "
                     f"chunk {ok['chunk_p50']}; errors {r['errors']}")
        per_req, per_chunk = r.get("sidecar_cpu_ms_per_request"), r.get("sidecar_cpu_ms_per_chunk")
        if per_req is not None:
            lines.append(f"{'':>5}   sidecar CPU: {per_req:.3f} ms per request, {per_chunk or 0:.3f} ms per content "
                         "chunk (all of it / chunks; median over repeats)")
    if report["config"].get("plain"):
        lines.append("engine: plain decoding (--plain: examples/policies/off.yaml)")
    lines.append(f"load average during the run: {', '.join(f'{x:.2f}' for x in report['load_average'])}")
    return "\n".join(lines)


def _spread(lo: float | None, hi: float | None) -> str:
    return "-" if lo is None or hi is None else f"{lo:+.2f}..{hi:+.2f}"


@click.command("sidecar")
@click.option("--base-url", default=None, help="A running engine (default: start `specops serve` on the bundled models).")
@click.option("--engine", type=click.Choice(["specops", "vllm", "sglang", "llamacpp"]), default="specops",
              show_default=True,
              help="The engine behind --base-url (which response fields the sidecar reads); llamacpp: start two "
                   "llama-server pools and compare per-class routing with all-spec / all-plain "
                   "(specops.bench.sidecar_llamacpp).")
@click.option("--policy", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Policy for the sidecar (and the started server); default: examples/policies/default.yaml.")
@click.option("--concurrency", default=None,
              help="Comma-separated max concurrencies [default: 1,16; llamacpp: 1,4].")
@click.option("--num-prompts", type=click.IntRange(min=2), default=None,
              help="Requests per cell (default 4 x conc, >= 16; llamacpp: >= 8).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL with 'prompt' (and 'temperature') or one prompt per line; default: bench serve's mix.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--server-arg", "server_args", multiple=True,
              help="Extra argument for the started server (llamacpp: for both pools; repeatable).")
@click.option("--plain", is_flag=True,
              help="Start the engine with examples/policies/off.yaml (plain decoding: less step-time jitter); "
                   "the sidecar keeps --policy.")
@click.option("--model", "gguf_model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="llamacpp: the pools' GGUF model (default: the bundled target, converted once).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="llamacpp: --threads of each pool.")
@click.option("--parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="llamacpp: --parallel slots of each pool.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_sidecar_command(base_url, engine, policy, concurrency, num_prompts, repeats, max_tokens, prompts_file, seed,
                          server_args, plain, gguf_model, threads, parallel, json_path, quiet) -> None:
    """Measure the sidecar's overhead: the same streams direct and through it (TTFT, per chunk).

    With --engine llamacpp: per-class routing over two llama-server pools against all-spec / all-plain.
    """
    llamacpp = engine == "llamacpp"
    try:
        conc = [int(c) for c in (concurrency or ("1,4" if llamacpp else "1,16")).split(",") if c.strip()]
        if not conc or min(conc) < 1:
            raise ValueError("--concurrency wants positive integers")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--concurrency") from None
    if llamacpp:
        given = [name for name, value in (("--base-url", base_url), ("--policy", policy), ("--prompts", prompts_file),
                                          ("--plain", plain)) if value]
        if given:
            raise click.UsageError(f"--engine llamacpp starts its own pools with its two-class policy and mix: "
                                   f"{', '.join(given)} does not apply")
        from specops.bench.sidecar_llamacpp import LlamaBenchConfig, format_table as llama_table, run_llamacpp_bench

        lcfg = LlamaBenchConfig(model=gguf_model, concurrency=conc, num_prompts=num_prompts, repeats=repeats,
                                max_tokens=max_tokens, threads=threads, parallel=parallel, seed=seed,
                                server_args=list(server_args), progress=not quiet)
        try:
            report = run_llamacpp_bench(lcfg)
        except BenchServeError as exc:
            raise click.ClickException(str(exc)) from None
        emit_report(report, llama_table(report), json_path)
        return
    if gguf_model:
        raise click.UsageError("--model is for --engine llamacpp (the pools' GGUF file)")
    cfg = OverheadConfig(base_url=base_url, engine=engine, policy=policy, concurrency=conc, num_prompts=num_prompts,
                         repeats=repeats, max_tokens=max_tokens, prompts_file=prompts_file, seed=seed,
                         server_args=list(server_args), plain=plain, progress=not quiet)
    try:
        report = run_overhead(cfg)
    except BenchServeError as exc:
        raise click.ClickException(str(exc)) from None
    emit_report(report, format_table(report), json_path)
