"""``specops bench turns``: per-turn policies against one chat class, over HTTP.

The measured half of "the conversation turn as a class attribute": the same
multi-turn conversations (the bundled ``chat`` suite, `chat_suite_conversations`)
are sent as streaming ``/v1/chat/completions`` requests with the whole ``messages``
history, so the server derives each request's turn itself (1 + the assistant
messages before it). A conversation's turns go one after the other; up to
``--concurrency`` conversations run at once.

One server per policy, each on its own namespace of one embedded Redis, so each
loads its policy file as the bootstrap policy: every policy runs ``adaptive``
(its initial settings, then ``specops controller run`` on its namespace, warmed up
on other conversations of the suite), plus one more server with every class
``off`` (plain decoding) as the baseline. Each repetition sends the whole workload
to every server in turn (the order rotates per repetition, so drift of a shared
machine's load falls on all of them alike).

Per policy and turn bucket (``1``, ``2``, ``3+`` and ``all``), medians over the
repetitions of: output tokens/s (a bucket's output tokens / the summed E2E time of
its requests — the speed one client sees), TTFT and TPOT p50 / p99, acceptance, and
``speedup`` — the median over repetitions of tokens/s / the ``off`` server's
tokens/s for the same bucket in the same repetition. ``all`` rows also carry the
wall-clock aggregate tokens/s. Each row counts the request classes the server
reported (its ``specops`` object), ``drafted_per_request`` (0: the server's planner
chose plain decoding throughout), and ``turn_mismatches`` the requests whose
server-derived turn differs from the one the history implies.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from specops.bench.serve import (BenchServeError, RequestResult, ServeBenchConfig, _apply_mode, _percentile,
                                 _start_controller, _start_server, _stop, _wait_ready, _wait_settings, emit_report)
from specops.bench.serve.stats import median_known
from specops.policies.turns import TURN_BUCKETS, turn_bucket

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "policies"
OFF = "off"
ALL = "all"
Conversation = list[tuple[str, str]]


@dataclass
class TurnsBenchConfig:
    policies: list[str] = field(default_factory=lambda: ["chat", "chat-single"])  # names in examples/ or paths
    conversations: int = 6
    turns: int = 3
    max_tokens: int = 32
    concurrency: int = 1                   # conversations in flight at once
    repetitions: int = 3
    warmup_conversations: int = 2          # per server, from another seed, before measuring
    controller_interval_s: float = 2.0
    adaptive_warmup_s: float = 6.0
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    progress: bool = True


@dataclass
class TurnResult(RequestResult):
    turn: int = 0                 # 1 + assistant messages in the history sent
    server_turn: int | None = None
    request_class: str | None = None


def resolve_policy(spec: str) -> tuple[str, Path]:
    """(name, file) for ``chat`` (examples/policies/chat.yaml) or a path to a YAML file."""
    path = Path(spec) if spec.endswith((".yaml", ".yml")) or "/" in spec else EXAMPLES_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise BenchServeError(f"policy {spec!r}: no file {path}")
    name = path.stem
    if name == OFF:
        raise BenchServeError("a policy may not be named 'off' (the baseline's name)")
    return name, path.resolve()


def chat_workload(conversations: int, turns: int, seed: int) -> list[Conversation]:
    """The chat suite's conversations (user, assistant, ..., user), the same for every server."""
    from specops.bench.suites import SuiteError, chat_suite_conversations
    from specops.train.data import heldout_files

    try:
        return chat_suite_conversations(list(heldout_files()), conversations=conversations, turns=turns,
                                        seed=seed)
    except SuiteError as exc:
        raise BenchServeError(str(exc)) from None


def turn_histories(conversation: Conversation) -> list[tuple[int, list[dict[str, str]]]]:
    """(turn, ``messages``) per user message: the history up to and including it."""
    out = []
    for i, (role, _) in enumerate(conversation):
        if role == "user":
            history = [{"role": r, "content": c} for r, c in conversation[: i + 1]]
            out.append((1 + sum(1 for m in history if m["role"] == "assistant"), history))
    return out


# -- the load generator ---------------------------------------------------------------------
async def _one_chat(client: Any, url: str, model: str, turn: int, messages: list[dict[str, str]],
                    max_tokens: int) -> TurnResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = TurnResult(ok=False, turn=turn)
    start, last = time.perf_counter(), None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    spec = chunk.get("specops") or {}
                    res.drafted, res.accepted = spec.get("drafted") or 0, spec.get("accepted") or 0
                    res.server_turn, res.request_class = spec.get("turn"), spec.get("request_class")
        res.e2e_s = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage chunk"
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_conversations(url: str, model: str, conversations: list[Conversation], concurrency: int,
                            max_tokens: int, on_done=None) -> tuple[list[TurnResult], float]:
    """Every conversation turn by turn (the next turn after the previous reply), ``concurrency`` at once."""
    import httpx

    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    results: list[TurnResult] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                conv = queue.get_nowait()
                for turn, messages in turn_histories(conv):
                    results.append(await _one_chat(client, url, model, turn, messages, max_tokens))
                    if on_done is not None:
                        on_done()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(conversations)))))
        return results, time.perf_counter() - start


# -- figures ---------------------------------------------------------------------------------
def bucket_figures(results: list[TurnResult], duration_s: float | None = None) -> dict[str, Any]:
    """One pass's figures over ``results`` (all of one bucket, or all; ``duration_s`` for ``all``)."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    busy = sum(r.e2e_s for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    drafted = sum(r.drafted for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens,
        "output_tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "aggregate_tokens_per_s": tokens / duration_s if duration_s else None,
        "ttft_p50_s": _percentile([r.ttft_s for r in ok], 0.5), "ttft_p99_s": _percentile([r.ttft_s for r in ok], 0.99),
        "tpot_p50_s": _percentile(tpots, 0.5), "tpot_p99_s": _percentile(tpots, 0.99),
        "acceptance_rate": sum(r.accepted for r in ok) / drafted if drafted else None,
        "drafted": drafted,
        "classes": dict(Counter(r.request_class or "?" for r in ok)),
        "turn_mismatches": sum(1 for r in ok if r.server_turn != r.turn),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
    }


def pass_figures(results: list[TurnResult], duration_s: float) -> dict[str, dict[str, Any]]:
    """Bucket (``1``, ``2``, ``3+``, ``all``) -> `bucket_figures` for one pass."""
    out = {b: bucket_figures([r for r in results if turn_bucket(r.turn) == b])
           for b in TURN_BUCKETS if any(turn_bucket(r.turn) == b for r in results)}
    out[ALL] = bucket_figures(results, duration_s)
    return out


MEDIAN_KEYS = ("output_tokens_per_s", "aggregate_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
               "acceptance_rate")


def combine(passes: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Rows (server × bucket) with medians over repetitions and the speedup against ``off``.

    ``passes``: ``{"repetition", "server", "figures": pass_figures(...)}`` per pass.
    """
    by = {(p["repetition"], p["server"]): p["figures"] for p in passes}
    reps = sorted({p["repetition"] for p in passes})
    rows = []
    for name in names:
        buckets = [b for b in (*TURN_BUCKETS, ALL) if any(b in by.get((r, name), {}) for r in reps)]
        for b in buckets:
            figs = [by[(r, name)][b] for r in reps if b in by.get((r, name), {})]
            row: dict[str, Any] = {"policy": name, "turn": b, "repetitions": len(figs)}
            row.update({k: median_known([f[k] for f in figs]) for k in MEDIAN_KEYS})
            ratios = []
            for r in reps:
                mine, base = by.get((r, name), {}).get(b), by.get((r, OFF), {}).get(b)
                if mine and base and base["output_tokens_per_s"] > 0:
                    ratios.append(mine["output_tokens_per_s"] / base["output_tokens_per_s"])
            row["speedup"] = median_known(ratios)
            row["requests"] = sum(f["requests"] for f in figs)
            row["errors"] = sum(f["errors"] for f in figs)
            row["turn_mismatches"] = sum(f["turn_mismatches"] for f in figs)
            row["drafted_per_request"] = sum(f["drafted"] for f in figs) / max(1, row["requests"] - row["errors"])
            classes: Counter[str] = Counter()
            for f in figs:
                classes.update(f["classes"])
            row["classes"] = dict(sorted(classes.items()))
            row["output_tokens_per_s_reps"] = [f["output_tokens_per_s"] for f in figs]
            row["error_samples"] = sorted({e for f in figs for e in f["error_samples"]})[:3]
            rows.append(row)
    return rows


# -- servers ---------------------------------------------------------------------------------
@dataclass
class _Server:
    name: str
    policy: Path
    cfg: ServeBenchConfig
    workdir: Path
    proc: Any = None
    url: str = ""
    controller: Any = None


def run_bench_turns(cfg: TurnsBenchConfig) -> dict[str, Any]:
    """Start the servers, warm up, run every repetition; returns ``{"config", "model", "repetitions", "rows",
    "final_settings", "passes"}`` (final_settings: each policy server's class -> method, gamma at the end)."""
    import redis as redis_lib

    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore

    if cfg.repetitions < 1 or cfg.concurrency < 1:
        raise BenchServeError("repetitions and concurrency must be >= 1")
    policies = [resolve_policy(p) for p in cfg.policies]
    names = [n for n, _ in policies]
    if not names or len(set(names)) != len(names):
        raise BenchServeError(f"policies need distinct file names, got {', '.join(names) or 'none'}")
    workload = chat_workload(cfg.conversations, cfg.turns, cfg.seed)
    warmup = chat_workload(cfg.warmup_conversations, cfg.turns, cfg.seed + 1) if cfg.warmup_conversations else []
    root = Path(tempfile.mkdtemp(prefix="specops-bench-turns-"))
    servers = [_Server(n, p, ServeBenchConfig(namespace=f"turns-{i}", controller_interval_s=cfg.controller_interval_s,
                                              server_args=["--policy", str(p), *cfg.server_args]), root / f"s{i}")
               for i, (n, p) in enumerate([(OFF, policies[0][1]), *policies])]
    embedded = None
    try:
        embedded = connect(None, root / "redis")
        redis_url = f"unix://{embedded.socket_file}"
        for s in servers:  # load them side by side
            s.workdir.mkdir()
            s.proc, s.url = _start_server(s.cfg, redis_url, s.workdir, max(2, cfg.concurrency))
        model = "bundled"
        for s in servers:
            model = _wait_ready(s.url, 600, s.proc).get("model", model)
            store = PolicyStore(redis_lib.Redis.from_url(redis_url), namespace=s.cfg.namespace)
            _wait_settings(s.url, _apply_mode(store, OFF if s.name == OFF else "adaptive"))
            if s.name != OFF:
                s.controller = _start_controller(s.cfg, redis_url, s.workdir)
        for s in servers:
            if warmup:
                asyncio.run(run_conversations(s.url, model, warmup, cfg.concurrency, cfg.max_tokens))
        if any(s.controller for s in servers):  # a few controller ticks over the warm-up telemetry
            time.sleep(cfg.adaptive_warmup_s)
        per_pass = sum(len(turn_histories(c)) for c in workload)
        bar = (click.progressbar(length=per_pass * len(servers) * cfg.repetitions, label="bench turns", file=sys.stderr)
               if cfg.progress else None)
        passes = []
        try:
            for rep in range(cfg.repetitions):
                shift = rep % len(servers)
                for s in servers[shift:] + servers[:shift]:
                    results, duration = asyncio.run(run_conversations(
                        s.url, model, workload, cfg.concurrency, cfg.max_tokens,
                        on_done=(lambda: bar.update(1)) if bar else None))
                    passes.append({"repetition": rep, "server": s.name, "duration_s": duration,
                                   "figures": pass_figures(results, duration)})
        finally:
            if bar is not None:
                bar.render_finish()
        config = asdict(cfg)
        config["policy_files"] = {n: str(p) for n, p in policies}
        final = {s.name: {c: {k: v.get(k) for k in ("method", "gamma")}
                          for c, v in _wait_ready(s.url, 60)["policy"].get("classes", {}).items()}
                 for s in servers if s.name != OFF}  # where each controller left the settings
        return {"config": config, "model": model, "repetitions": cfg.repetitions,
                "rows": combine(passes, [OFF, *names]), "final_settings": final, "passes": passes}
    finally:
        for s in servers:
            if s.controller is not None:
                _stop(s.controller)
            if s.proc is not None:
                _stop(s.proc)
        if embedded is not None:
            embedded.connection_pool.disconnect()
            close(embedded)


# -- output ----------------------------------------------------------------------------------
def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_turns_table(report: dict[str, Any]) -> str:
    head = (f"{'policy':<13}{'turn':>5}{'req':>5}{'err':>4}{'tok/s':>8}{'x off':>7}{'TTFT p50':>10}"
            f"{'TPOT p50':>10}{'p99':>8}{'accept':>8}{'drft/req':>9}  classes")
    lines = [head, f"  (medians over {report['repetitions']} repetitions; latencies in ms; tok/s per stream)"]
    for r in report["rows"]:
        classes = ",".join(f"{k}:{v}" for k, v in r["classes"].items())
        lines.append(f"{r['policy']:<13}{r['turn']:>5}{r['requests']:>5}{r['errors']:>4}"
                     f"{r['output_tokens_per_s']:>8.1f}{_fmt(r['speedup'], 1, 2):>7}{_fmt(r['ttft_p50_s'], 1000):>10}"
                     f"{_fmt(r['tpot_p50_s'], 1000):>10}{_fmt(r['tpot_p99_s'], 1000):>8}"
                     f"{_fmt(r['acceptance_rate'], 1, 2):>8}{r['drafted_per_request']:>9.1f}  {classes}")
    return "\n".join(lines)


def plot_turns(report: dict[str, Any], path: str | Path) -> Path:
    """Two panels per turn bucket: speedup against off, and acceptance; one bar per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in report["rows"] if r["policy"] != OFF]
    names = list(dict.fromkeys(r["policy"] for r in rows))
    buckets = list(dict.fromkeys(r["turn"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        mine = {r["turn"]: r for r in rows if r["policy"] == name}
        xs = [j + i * width for j in range(len(buckets))]
        axes[0].bar(xs, [mine[b]["speedup"] or 0 for b in buckets], width, label=name)
        axes[1].bar(xs, [mine[b]["acceptance_rate"] or 0 for b in buckets], width, label=name)
    for ax, title in zip(axes, ("output tokens/s / off", "acceptance")):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(buckets))], [f"turn {b}" for b in buckets])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    axes[0].axhline(1.0, color="grey", lw=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command("turns")
@click.option("--policies", default="chat,chat-single", show_default=True,
              help="Comma-separated policy names in examples/policies/ or YAML paths; each gets its own server.")
@click.option("--conversations", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True, help="User turns per conversation.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Conversations in flight at once.")
@click.option("--repetitions", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True,
              help="Warm-up conversations per server (another seed) before measuring.")
@click.option("--adaptive-warmup-s", type=click.FloatRange(min=0), default=6.0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--server-arg", "server_args", multiple=True,
              help="Extra argument for every started server (repeatable), e.g. --server-arg=--threads --server-arg=1.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_turns_command(policies, conversations, turns, max_tokens, concurrency, repetitions, warmup, adaptive_warmup_s,
                        json_path, plot_path, seed, server_args, quiet) -> None:
    """Multi-turn chat over HTTP: each policy adaptive on its own server against an all-off server, per turn."""
    cfg = TurnsBenchConfig(policies=[p.strip() for p in policies.split(",") if p.strip()], conversations=conversations,
                           turns=turns, max_tokens=max_tokens, concurrency=concurrency, repetitions=repetitions,
                           warmup_conversations=warmup, adaptive_warmup_s=adaptive_warmup_s, seed=seed,
                           server_args=list(server_args), progress=not quiet)
    try:
        report = run_bench_turns(cfg)
    except BenchServeError as exc:
        raise click.ClickException(str(exc)) from None
    emit_report(report, format_turns_table(report), json_path, plot_path, plot_turns)
