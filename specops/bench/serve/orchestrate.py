"""The orchestration of ``specops bench serve``: every mode × concurrency cell, in which order, on which
server, with its warm-up and (one server) settle traffic; see `run_bench_serve`."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from specops.bench.serve import load, procs, scrape, settings
from specops.bench.serve.model import LoneTarget, prepare_lone_target
from specops.bench.serve.config import CHAT_SUITE, BenchServeError, ServeBenchConfig, cell_requests
from specops.bench.serve.prompts import PromptTags, build_prompts, mix_classes
from specops.bench.serve.stats import goal_ratios, goal_resolution, median_row, paired_ranges, paired_ratios, summarize


@dataclass
class _Target:
    """Where one mode's cells are sent: its server URL and its Redis namespace."""
    mode: str
    url: str
    store: Any
    namespace: str


def cell_order(modes: list[str], repeat: int, index: int) -> list[str]:
    """The order of the modes' cells in repeat ``repeat`` at the ``index``-th concurrency: rotated
    by both, in a Williams design. Rotation alone put every mode in every position, but behind the
    same predecessor each time (off after adaptive, fixed after off, ...), so whatever a cell
    leaves behind for the next one fell on one mode: in one run, off-twin (set exactly like
    off, behind adaptive in three repeats of four) read 1.03-1.09x off at c1 in all four repeats.
    The rows of a Williams square (0, 1, n-1, 2, n-2, ... shifted by the row) put each mode behind
    each other one equally often over n repeats for an even number of modes n; for an odd n, the
    rows are rotations and every odd repeat runs its row reversed, which does the same over 2n
    repeats (6 for off, fixed, adaptive). Every position is held equally often either way."""
    n = len(modes)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    row = [modes[(b + repeat + index) % n] for b in base]
    return row[::-1] if n % 2 and repeat % 2 else row


def run_bench_serve(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run every mode × concurrency cell; returns ``{"config", "results"}``.

    A started server (no ``--base-url``): one server process per mode, each on its own Redis
    namespace (``NAMESPACE-MODE``; the controller runs against the adaptive one), all started
    and warmed first; then repeat r runs, for each concurrency, every mode's cell back to back,
    in `cell_order` (rotated by the repeat and the concurrency, a Williams design); the controller
    is paused after its server's warm-up and runs only during the adaptive cells. The machine's
    speed drifts over minutes, and modes measured minutes apart compared that drift as often as
    the modes. A running server (``--base-url``) holds one setting at a time, so there the modes
    run one after the other.

    ``one_server`` (``--one-server``): one started server serves every mode, in the same
    interleaved order. It is warmed in the adaptive mode with the controller running; then
    each cell writes its mode's settings (adaptive: the settings the controller left at the
    end of its previous cell) and waits until ``/readyz`` shows them, sends ``settle_s``
    seconds of unmeasured traffic at the cell's concurrency, and is measured. The controller
    runs only during adaptive cells (paused with SIGSTOP otherwise, so it neither overrides
    the other modes' settings nor reads their requests: its first window after resuming holds
    the settle traffic, served under its own settings). The modes' ratios are then taken
    within one process: two identical server processes differed by up to 27% at 16 streams
    in one run (``--twin``), more than the goals' margins.

    ``model`` (``--model``): the started servers serve that target alone, on the policy
    `prepare_lone_target` writes (the model resolved, and pulled on first use, before any
    server starts); the report's ``model_target`` says which methods and why.
    """
    import redis as redis_lib

    from specops.policies.errors import StateError, StoreUnavailableError
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore

    if cfg.model is not None and cfg.base_url:
        raise BenchServeError("--model picks the target of the servers the bench starts: it cannot be combined "
                              "with --base-url (that server serves its own model)")
    if cfg.base_url and not cfg.redis_url:
        raise BenchServeError("a running server (--base-url) needs --redis, the server's Redis, to switch modes")
    if cfg.twin and (cfg.base_url or "off" not in cfg.modes):
        raise BenchServeError("--twin measures a second `off` beside `off`: it needs started servers (no "
                              "--base-url) and off among --modes")
    if cfg.one_server and cfg.base_url:
        raise BenchServeError("--one-server starts its server: it cannot be combined with --base-url")
    if cfg.settle_s is not None and not cfg.one_server:
        raise BenchServeError("--settle-s is the traffic before each cell of --one-server; add --one-server")
    modes = cfg.all_modes
    workdir = Path(tempfile.mkdtemp(prefix="specops-bench-serve-"))
    embedded = controller = client = None
    servers: list[subprocess.Popen] = []
    bar = None
    lone: LoneTarget | None = None
    try:
        server_cfg = cfg
        if cfg.model is not None:  # resolved (pulled on first use) and its policy written before any server starts
            lone = prepare_lone_target(cfg.model, cfg.server_args, workdir, progress=cfg.progress,
                                       chat=cfg.suite == CHAT_SUITE)
            click.echo(lone.note, err=True)
            server_cfg = replace(cfg, server_args=lone.server_args(cfg.server_args))
        redis_url = cfg.redis_url
        if redis_url is None:
            embedded = connect(None, workdir / "redis")
            redis_url = f"unix://{embedded.socket_file}"
        client = redis_lib.Redis.from_url(redis_url)
        if cfg.base_url:
            url = cfg.base_url.rstrip("/")
            targets = {m: _Target(m, url, PolicyStore(client, namespace=cfg.namespace), cfg.namespace)
                       for m in modes}
        elif cfg.one_server:
            proc, url = procs._start_server(server_cfg, redis_url, workdir, max(cfg.concurrency), cfg.namespace)
            servers.append(proc)
            procs._wait_ready(url, 600, proc)
            store = PolicyStore(client, namespace=cfg.namespace)
            targets = {m: _Target(m, url, store, cfg.namespace) for m in modes}
        else:
            targets = {}
            for mode in modes:
                ns = f"{cfg.namespace}-{mode}"
                proc, url = procs._start_server(server_cfg, redis_url, workdir, max(cfg.concurrency), ns, name=f"serve-{mode}")
                servers.append(proc)
                targets[mode] = _Target(mode, url, PolicyStore(client, namespace=ns), ns)
            for proc, t in zip(servers, targets.values()):
                procs._wait_ready(t.url, 600, proc)
        first = next(iter(targets.values()))
        model = procs._wait_ready(first.url, 60).get("model", "bundled")
        counts = {c: cfg.num_prompts or cell_requests(c) for c in cfg.concurrency}
        total = sum(counts.values()) * len(modes) * cfg.repeats
        bar = click.progressbar(length=total, label="bench serve", file=sys.stderr) if cfg.progress else None
        on_done = (lambda: bar.update(1)) if bar else None
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {(m, c): [] for m in modes for c in cfg.concurrency}
        tags = PromptTags(cfg.warm_prefix)

        def prepare(t: _Target, traffic: bool) -> subprocess.Popen | None:
            """Set the mode, warm the server; ``traffic``: then `_adaptive_warmup`'s traffic (the
            adaptive mode always: its controller needs it; with started servers every mode, so each
            server is measured after the same history)."""
            expected = settings._apply_mode(t.store, t.mode)
            settings._wait_settings(t.url, expected)
            started = (procs._start_controller(cfg, redis_url, workdir, t.namespace, paused=not cfg.base_url)
                       if t.mode == "adaptive" else None)
            warm = tags.fresh(build_prompts(cfg, max(cfg.warmup, 1)))
            asyncio.run(load.run_cell(t.url, model, warm, min(len(warm), max(cfg.concurrency)), cfg))
            if traffic:
                load._adaptive_warmup(t.url, model, cfg, tags)
            return started

        def measure(t: _Target, c: int) -> None:
            before = scrape.planner_counts(t.url)
            prompts = tags.fresh(build_prompts(cfg, counts[c]))
            results, duration = asyncio.run(load.run_cell(t.url, model, prompts, c, cfg, on_done=on_done))
            row = summarize(t.mode, c, results, duration, cfg)
            row["prompts"] = cfg.prompts_label
            row["settings"] = settings._settings_text(t.url)  # at the cell's end (adaptive: what the controller chose)
            after = scrape.planner_counts(t.url)
            row.update(scrape.planner_delta(before, after))
            row.update(scrape.cpu_delta(before, after, row["output_tokens"]))
            runs[(t.mode, c)].append(row)

        if cfg.base_url:
            for mode in modes:
                controller = prepare(targets[mode], traffic=mode == "adaptive")
                for _ in range(cfg.repeats):
                    for c in cfg.concurrency:
                        measure(targets[mode], c)
                if controller is not None:
                    procs._stop(controller)
                    controller = None
        elif cfg.one_server:
            # warmed once, in the adaptive mode when measured (its controller acts on the warm-up), then
            # paused with its settings kept; every cell sets its mode, settles, and is measured (on `store`,
            # the one server's, from above)
            controller = prepare(targets["adaptive" if "adaptive" in modes else modes[0]], traffic=True)
            procs._pause(controller)
            kept = store.effective()
            for r in range(cfg.repeats):
                for j, c in enumerate(cfg.concurrency):
                    for mode in cell_order(modes, r, j):
                        t = targets[mode]
                        adaptive = t.mode == "adaptive"
                        expected = (settings._restore_adaptive(store, kept) if adaptive
                                    else settings._apply_mode(store, t.mode))
                        settings._wait_settings(t.url, expected)
                        load._settle(t.url, model, cfg, c, build_prompts(cfg, counts[c]), tags)
                        if adaptive:
                            procs._resume(controller)
                        measure(t, c)
                        if adaptive:
                            procs._pause(controller)
                            kept = store.effective()
        else:
            # the controller acts on its server's warm-up, then is paused but for the adaptive cells:
            # it runs on the same host's CPUs as the other servers, and would otherwise keep adapting
            # (and spending them) while they are measured
            for t in targets.values():
                started = prepare(t, traffic=True)
                if started is not None:
                    controller = started
                    procs._pause(controller)
            for r in range(cfg.repeats):
                for j, c in enumerate(cfg.concurrency):  # the cells compared with each other back to back
                    for mode in cell_order(modes, r, j):
                        adaptive = mode == "adaptive"
                        if adaptive:
                            procs._resume(controller)
                        measure(targets[mode], c)
                        if adaptive:
                            procs._pause(controller)
        rows = [median_row(runs[(m, c)]) for m in modes for c in cfg.concurrency]
        cfg_out = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        cfg_out["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
        cfg_out["interleaved"] = not cfg.base_url
        cfg_out["settle_s"] = cfg.settle_seconds if cfg.one_server else None
        cfg_out["prompts"] = cfg.prompts_label
        report = {"config": cfg_out, "model": model, "results": rows}
        if lone is not None:
            report["model_target"] = lone.report()
        try:  # the revision the servers run (every mode: the same file)
            policy = first.store.current_policy()
        except (StoreUnavailableError, StateError, redis_lib.RedisError) as exc:  # the figures stand without it
            policy = None
            report["classes_error"] = str(exc)
        if policy is not None:
            report["policy_version"] = policy.version
            report["classes"] = mix_classes(policy, cfg, counts, tags)
        report["ratios"], report["paired_ratios"] = goal_ratios(report), paired_ratios(report)
        report["paired_ranges"] = {k: list(v) for k, v in paired_ranges(report).items()}
        report["resolution"] = goal_resolution(report)
        return report
    finally:
        if bar is not None:
            bar.render_finish()
        if controller is not None:
            procs._stop(controller)
        for proc in servers:
            procs._stop(proc)
        if client is not None:
            client.close()
        if embedded is not None:
            embedded.connection_pool.disconnect()  # idle pooled connections would count as other users
            close(embedded)
