"""``specops bench serve``: load a running (or self-started) ``specops serve`` over HTTP.

Like ``vllm bench serve``: streaming ``/v1/completions`` requests from a prompt mix,
arriving all at once or as a Poisson process (``--request-rate``), capped by a
max-concurrency semaphore. Per mode × concurrency it reports output tokens/s,
requests/s, TTFT / TPOT / ITL / E2E p50 and p99, errors and goodput under ``--slo``.

Modes switch the server through its Redis, as an operator would:

``off``       every class's effective method set to ``off`` (plain decoding);
``fixed``     the policy's initial settings (`effective_for`), no controller;
``adaptive``  the initial settings, then ``specops controller run`` as its own process
              against the same Redis, adapting from the server's telemetry; measured after
              ``--adaptive-warmup-s`` (45 s) of the same traffic mix, so the controller has
              had its ticks and its alert rules their ``for_s``.

With started servers every mode's server gets that same warm-up traffic (the controller
runs only beside the adaptive one, and is paused, SIGSTOP, outside the adaptive cells: it
neither adapts nor spends the host's CPUs while the other modes are measured), so all are
measured after the same history: a server
that had served 45 s more traffic than the one it was compared with read 0.92-0.96x of it
at c = 16 in two runs of three, with its speculation off in 99% of steps (and 1.02-1.04x
in two of two with the traffic equal).

The bench waits until the server's ``/readyz`` shows the settings before measuring.
A started server is one process per mode (its own Redis namespace), and repeat r runs,
for each concurrency, every mode's cell back to back, the order rotated by r and the
concurrency, so the machine's drift over minutes falls on every mode alike; against
``--base-url`` the modes run one after the other. ``--one-server``: one started process
serves every mode in that same order, its settings switched through Redis before each cell
and ``--settle-s`` of unmeasured traffic in the new mode before measuring (the controller
paused outside the adaptive cells: see `run_bench_serve`), so the ratios compare modes and
not processes.
With ``--repeats R`` every cell runs R times; a row is the repeat with the median output
tokens/s (a measured row, its latencies from the same run), with every repeat's tokens/s
beside it and each class's live setting at the end of that run (``settings``), and what the
server's speculation planner did in that run (from its ``/metrics``: ``spec_step_share``, the
decode steps where some sequence speculated; ``vetoes``; ``probes``). An
interleaved run also reports the goal ratios paired per repeat (the median over repeats
of each repeat's own ratio, ``paired_ratios``), beside the ratios of the medians. Below the
table, the ratios the serving goals are stated in (off c_max / c_min, adaptive / off,
adaptive / max(off, fixed)) from those medians.
``--twin`` (started servers): a fourth server, ``off-twin``, set like ``off`` and measured in
the same interleaving; ``off-twin / off`` beside the goal ratios is how far two identical
server processes differ in this run, the noise floor those ratios between processes carry
(with ``--one-server``, a fourth mode set like ``off`` on the one server: the noise floor of
two cells of the same thing); ``off-twin / max(off, fixed)`` is the goal's ratio read for a
mode that decodes exactly like ``off``, what ``adaptive`` reads where it decodes plainly too.
An interleaved run with 3+ repeats also reports the goal's resolution (`goal_resolution`):
how often a mode exactly like the better of ``off`` and ``fixed`` would read adaptive /
max(off, fixed) >= 0.97, in simulated runs whose cells vary as this run's ``off`` and
``fixed`` cells did (each repeat's common drift plus each cell's own spread). Far below
100%, that goal's verdict at that concurrency is the host's noise, not the modes.
``cpu ms/tok``: the server process's CPU time per output token in the cell, from its
``process_cpu_seconds_total`` (`cpu_delta`; the median over repeats).
Prompts are fresh by default: every measured cell and every batch of warm-up or settle
traffic starts with a tag line of its own (`PromptTags`), so no cell finds the prompts of
another repeat, mode or settle batch in the server's prefix cache, only repeats of a prompt
within the cell. ``--warm-prefix`` replays the same texts in every repeat and in the settle
traffic (warm-prefix-cache figures); the table's first line and the JSON (``prompts``) say which.
Terms: TTFT = arrival → first token; TPOT = (E2E − TTFT) / (output tokens − 1);
ITL = gaps between streamed chunks; goodput = requests/s meeting every SLO.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

MODES = ("off", "fixed", "adaptive")
TWIN = "off-twin"
"""``--twin``: a second server measured as ``off``. Two identical server processes differed by
5-10% at 16 streams in one run (session 25: 1.01-1.21x per repeat), and the mode ratios are
taken between processes; ``off-twin / off`` prints that spread beside them. With
``--one-server`` it is a fourth mode of the one server, set like ``off``: ``off-twin / off``
is then how far two cells of the same thing differ in one process (the cells' own noise)."""
# Fewest requests in a cell by default (and 8 per unit of concurrency). At concurrency 1,
# 8 requests are ~1 s of traffic: the same cell's repeats varied 309-524 tok/s, and a
# ratio of two such medians was noise; 24 still varied ±15% between repeats.
MIN_CELL_REQUESTS = 48
REQUESTS_PER_SLOT = 8
# From concurrency 2 on, also up to BATCHED_CELL_REQUESTS (32 per slot below that): 48 requests at
# concurrency 4 were a 5-6 s cell on the bundled models (c1's 48 took ~14 s, c16's 128 ~11 s), the
# shortest of a run, and its repeats spread the most (adaptive / off at c4 0.98-1.18x in one run).
BATCHED_CELL_REQUESTS = 128


def cell_requests(concurrency: int) -> int:
    """A cell's requests by default (``--num-prompts`` unset): at concurrency 1, 4 and 16 on the
    bundled models 48, 128 and 128, each ~10-15 s of traffic."""
    batched = min(32 * concurrency, BATCHED_CELL_REQUESTS) if concurrency > 1 else 0
    return max(MIN_CELL_REQUESTS, REQUESTS_PER_SLOT * concurrency, batched)


MIX_KINDS = ("code", "prose", "hot")


class BenchServeError(RuntimeError):
    """A configuration or server problem (one readable line)."""


@dataclass
class ServeBenchConfig:
    base_url: str | None = None
    redis_url: str | None = None
    namespace: str = "specops"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    num_prompts: int | None = None          # per cell; None: `cell_requests`
    request_rate: float = math.inf
    max_tokens: int = 64
    mix: dict[str, float] = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "hot": 0.2})
    prompts_file: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    api_key: str | None = None
    seed: int = 0
    warmup: int = 2
    repeats: int = 1                        # runs of every cell; rows are the median run
    controller_interval_s: float = 2.0
    adaptive_warmup_s: float = 45.0         # traffic before measuring (adaptive: controller ticks + alert for_s)
    server_args: list[str] = field(default_factory=list)
    twin: bool = False                      # also a second `off` server (TWIN), started servers only
    one_server: bool = False                # started: one server for every mode (see `run_bench_serve`)
    settle_s: float | None = None           # one_server: traffic before each cell (None: the controller's window)
    warm_prefix: bool = False               # replay the same prompt texts in every repeat and in the settle traffic
    progress: bool = True

    @property
    def window_s(self) -> float:
        """The started controller's telemetry window (``--window``)."""
        return max(5.0, 5 * self.controller_interval_s)

    @property
    def settle_seconds(self) -> float:
        return self.window_s if self.settle_s is None else self.settle_s

    @property
    def prompts_label(self) -> str:
        """``warm`` (`warm_prefix`: the cells' prompts replayed, found in the prefix cache) or ``fresh``."""
        return "warm" if self.warm_prefix else "fresh"

    @property
    def all_modes(self) -> list[str]:
        """The measured modes: ``modes`` and, with ``twin``, TWIN."""
        return [*self.modes, TWIN] if self.twin else list(self.modes)


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    observed: bool = False  # a canary's or a fallback probe's: speculating as set, the planner's veto aside
    fallen_back: bool = False  # decoded plainly because its class is fallen back
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_mix(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, weight = part.strip().partition(":")
        if not sep or name not in MIX_KINDS:
            raise ValueError(f"--mix wants KIND:WEIGHT with KIND in {', '.join(MIX_KINDS)}, got {part!r}")
        try:
            out[name] = float(weight)
        except ValueError:
            raise ValueError(f"--mix weight of {name} is not a number: {weight!r}") from None
        if out[name] < 0:
            raise ValueError(f"--mix weight of {name} must be >= 0")
    if not out or sum(out.values()) <= 0:
        raise ValueError("--mix needs a positive total weight")
    return out


def parse_slo(text: str) -> tuple[float | None, float | None]:
    ttft = tpot = None
    for part in text.split(","):
        name, sep, ms = part.strip().partition(":")
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(f"--slo wants ttft:MS,tpot:MS, got {part!r}")
        try:
            value = float(ms) / 1000.0
        except ValueError:
            raise ValueError(f"--slo {name} is not a number of milliseconds: {ms!r}") from None
        if value <= 0:
            raise ValueError(f"--slo {name} must be > 0 ms")
        ttft, tpot = (value, tpot) if name == "ttft" else (ttft, value)
    return ttft, tpot


@functools.lru_cache(maxsize=8)
def _suite_pools(seed: int) -> dict[str, list[tuple[str, float]]]:
    """The bundled suites' prompts by mix kind (parsed once: each cell draws from them)."""
    from specops.bench.suites import HOT_TEMPERATURE, builtin_suite

    return {"code": [(p.text, 0.0) for p in builtin_suite("code", seed=seed)],
            "prose": [(p.text, 0.0) for p in builtin_suite("prose", seed=seed)],
            "hot": [(p.text, HOT_TEMPERATURE) for p in builtin_suite("code", seed=seed + 1)]}


def build_prompts(cfg: ServeBenchConfig, count: int) -> list[tuple[str, float]]:
    """``count`` (prompt, temperature) pairs drawn from the mix (the same list for every mode)."""
    from specops.bench.suites import load_prompts_file

    rng = random.Random(cfg.seed)
    if cfg.prompts_file:
        pool = [(p.text, p.temperature) for p in load_prompts_file(cfg.prompts_file)]
        return [pool[i % len(pool)] for i in range(count)]
    pools = _suite_pools(cfg.seed)
    kinds = [k for k in MIX_KINDS if cfg.mix.get(k, 0) > 0]
    weights = [cfg.mix[k] for k in kinds]
    return [rng.choice(pools[rng.choices(kinds, weights)[0]]) for _ in range(count)]


class PromptTags:
    """What makes each batch of traffic fresh: unless ``warm`` (``--warm-prefix``), every measured
    cell and every batch of unmeasured traffic (warm-up, settle) gets its own first line,
    ``#SERIAL-RUN`` (SERIAL counts the batches, RUN is random per bench run, so a running server's
    cache holds nothing from an earlier run). A server's prefix cache chains each block's key to
    the blocks before it, so prompts whose first block differs share no cached block: a cell finds
    none of its prompts from another repeat, mode or settle batch there, only repeats of a prompt
    within itself (the mix draws with replacement). The tag is a Python comment line; class rules
    that look at a prompt's start (``prefix``, ``^`` regexes) see it, the built-in mix's classes
    are the same with and without it. ``warm``: batches go out as drawn, the same texts each
    repeat (and settle traffic replays the cell's own prompts), so those figures are of a warm
    prefix cache."""

    def __init__(self, warm: bool, run: str | None = None) -> None:
        self.warm = warm
        self.run = run if run is not None else secrets.token_hex(3)
        self.serial = 0

    def tag(self, serial: int) -> str:
        return f"#{serial}-{self.run}\n"

    def fresh(self, prompts: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """``prompts`` as the next batch sends them: behind a tag no batch had before (as they are when warm)."""
        if self.warm:
            return list(prompts)
        self.serial += 1
        tag = self.tag(self.serial)
        return [(tag + text, temperature) for text, temperature in prompts]

    def example(self, prompts: list[tuple[str, float]]) -> list[tuple[str, float]]:
        """``prompts`` as a batch would send them, without using up a tag (to classify them)."""
        return list(prompts) if self.warm else [(self.tag(0) + text, t) for text, t in prompts]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(mode: str, concurrency: int, results: list[RequestResult], duration_s: float,
              cfg: ServeBenchConfig) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl_s]
    good = [r for r in ok if (cfg.slo_ttft_s is None or r.ttft_s <= cfg.slo_ttft_s)
            and (cfg.slo_tpot_s is None or (r.tpot_s or 0.0) <= cfg.slo_tpot_s)]
    drafted = sum(r.drafted for r in ok)
    row = {
        "mode": mode, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "duration_s": duration_s, "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_p50_s": _percentile([r.ttft_s for r in ok], 0.5), "ttft_p99_s": _percentile([r.ttft_s for r in ok], 0.99),
        "tpot_p50_s": _percentile(tpots, 0.5), "tpot_p99_s": _percentile(tpots, 0.99),
        "itl_p50_s": _percentile(itls, 0.5), "itl_p99_s": _percentile(itls, 0.99),
        "e2e_p50_s": _percentile([r.e2e_s for r in ok], 0.5), "e2e_p99_s": _percentile([r.e2e_s for r in ok], 0.99),
        "goodput_rps": len(good) / duration_s if duration_s > 0 else 0.0,
        "acceptance_rate": sum(r.accepted for r in ok) / drafted if drafted else None,
        "observed_requests": sum(r.observed for r in ok), "fallen_back_requests": sum(r.fallen_back for r in ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
    }
    return row


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tokens/s (the lower middle of an even count), with every
    run's tokens/s (``output_tokens_per_s_runs``) and errors summed over the runs."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["repeats"] = len(runs)
    row["output_tokens_per_s_runs"] = [r["output_tokens_per_s"] for r in runs]
    row["errors_all_runs"] = sum(r["errors"] for r in runs)
    if "server_cpu_ms_per_token" in row:  # measured cells (`cpu_delta`): the median over the runs
        cpu = [r["server_cpu_ms_per_token"] for r in runs if r.get("server_cpu_ms_per_token") is not None]
        row["server_cpu_ms_per_token_runs"] = cpu
        row["server_cpu_ms_per_token"] = statistics.median(cpu) if cpu else None
    return row


def _goal_terms(concs: list[int], twin: bool = False) -> list[tuple[str, tuple[str, int], list[tuple[str, int]]]]:
    """Every ratio the serving goals are stated in: (name, numerator cell, denominator cells,
    of which the best counts) over the measured concurrencies ``concs`` (sorted); with ``twin``
    also ``off-twin / off``, two identical servers' ratio (the noise floor, no goal), and
    ``off-twin / max(off, fixed)``: the goal's own ratio for a mode that decodes exactly like
    ``off``. Where all modes decode plainly (c4 / c16 on a CPU) that is what ``adaptive`` reads
    too, and it sits below 1 by itself: the larger of two noisy cells of equal speed is on
    average above their common mean (by ~0.56 sigma of one cell)."""
    if not concs:
        return []
    lo, hi = concs[0], concs[-1]
    terms = [(f"off c{hi} / off c{lo}", ("off", hi), [("off", lo)])] if hi > lo else []
    for c in concs:
        terms.append((f"adaptive / off at c{c}", ("adaptive", c), [("off", c)]))
        terms.append((f"adaptive / max(off, fixed) at c{c}", ("adaptive", c), [("off", c), ("fixed", c)]))
    if twin:
        terms += [(f"{TWIN} / off at c{c}", (TWIN, c), [("off", c)]) for c in concs]
        terms += [(f"{TWIN} / max(off, fixed) at c{c}", (TWIN, c), [("off", c), ("fixed", c)]) for c in concs]
    return terms


def _has_twin(report: dict[str, Any]) -> bool:
    return any(r["mode"] == TWIN for r in report["results"])


def mix_classes(policy: Any, cfg: ServeBenchConfig, counts: dict[int, int],
                tags: PromptTags | None = None) -> dict[str, dict[str, int]]:
    """How each concurrency's cell of prompts splits into ``policy``'s classes, per class in policy
    order (as `specops policy classify` counts them: the requests carry no labels or turn, and
    length rules see the prompt's characters / ``CHARS_PER_TOKEN``), the prompts as ``tags``
    sends them (default: as drawn)."""
    from specops.policies.cli_classify import Sample, classify

    tags = tags or PromptTags(warm=True)
    out: dict[str, dict[str, int]] = {}
    for c, n in counts.items():
        names = [classify(policy, Sample(text, temperature, {})).request_class
                 for text, temperature in tags.example(build_prompts(cfg, n))]
        out[str(c)] = {rc.name: names.count(rc.name) for rc in policy.classes}
    return out


def goal_ratios(report: dict[str, Any]) -> dict[str, float]:
    """The ratios the serving goals are stated in, from the rows' (median) output tokens/s."""
    tps = {(r["mode"], r["concurrency"]): r["output_tokens_per_s"] for r in report["results"]}
    out: dict[str, float] = {}
    for name, num, dens in _goal_terms(sorted({c for _, c in tps}), _has_twin(report)):
        best = max((tps[d] for d in dens if d in tps), default=0.0)
        if num in tps and best > 0:
            out[name] = tps[num] / best
    return out


def _pairs(report: dict[str, Any]) -> dict[str, list[float]]:
    """Each goal ratio taken within each repeat (an interleaved run only, see `paired_ratios`)."""
    if not report.get("config", {}).get("interleaved"):
        return {}
    runs = {(r["mode"], r["concurrency"]): list(r.get("output_tokens_per_s_runs") or []) for r in report["results"]}
    out: dict[str, list[float]] = {}
    for name, num, dens in _goal_terms(sorted({c for _, c in runs}), _has_twin(report)):
        cols = [runs[d] for d in dens if runs.get(d)]
        if not runs.get(num) or not cols:
            continue
        n = min(len(runs[num]), *(len(col) for col in cols))
        pairs = [runs[num][i] / best for i in range(n) if (best := max(col[i] for col in cols)) > 0]
        if pairs:
            out[name] = pairs
    return out


def paired_ratios(report: dict[str, Any]) -> dict[str, float]:
    """The same ratios taken within each repeat, then the median over repeats: only for an
    interleaved run (``config.interleaved``), where repeat r of every mode ran minutes
    apart at most, so the host's drift cancels out of each pair."""
    return {name: statistics.median(pairs) for name, pairs in _pairs(report).items()}


def paired_ranges(report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """The lowest and highest per-repeat ratio of each goal term: how far one repeat can
    stray on this host, beside the median `paired_ratios` reports."""
    return {name: (min(pairs), max(pairs)) for name, pairs in _pairs(report).items()}


GOAL_FLOOR = 0.97
"""The serving goal's bound: adaptive >= GOAL_FLOOR x max(off, fixed) at every concurrency."""
RESOLUTION_DRAWS = 20000


def goal_resolution(report: dict[str, Any], floor: float = GOAL_FLOOR, draws: int = RESOLUTION_DRAWS,
                    seed: int = 0) -> dict[str, dict[str, float]]:
    """How well this run can tell the goal ``adaptive >= floor x max(off, fixed)`` at each
    concurrency: the chance that a mode decoding exactly like the better of ``off`` and
    ``fixed`` (no slower, no faster) reads at least ``floor``, over ``draws`` simulated runs
    whose cells vary as this run's ``off`` and ``fixed`` cells did.

    A cell's log tokens/s is the repeat's share (the host's drift over minutes, common to
    every mode of the repeat: ``drift_sd``) plus its own (``cell_sd``, estimated from the
    spread of log(off / fixed) within the repeats: var / 2, their mean difference removed);
    ``drift_sd`` is what the pooled spread of both modes about their means leaves. The
    simulated ratio is read as the table reads it (each mode's median run, ``p_median``)
    and as the paired ratio does (the median of the repeats' ratios, ``p_paired``). Well
    below 1, the goal's verdict at that concurrency is the host's noise, not the modes: the
    larger of two noisy cells sits above their common mean. Interleaved runs with 3+
    repeats of both ``off`` and ``fixed`` only."""
    import numpy as np

    if not report.get("config", {}).get("interleaved"):
        return {}
    runs = {(r["mode"], r["concurrency"]): list(r.get("output_tokens_per_s_runs") or []) for r in report["results"]}
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float]] = {}
    for c in sorted({c for _, c in runs}):
        off, fixed = runs.get(("off", c)) or [], runs.get(("fixed", c)) or []
        n = min(len(off), len(fixed))
        if n < 3 or min(off[:n] + fixed[:n]) <= 0:
            continue
        a, b = np.log(np.asarray(off[:n], dtype=float)), np.log(np.asarray(fixed[:n], dtype=float))
        cell_var = float(np.var(a - b, ddof=1)) / 2
        pooled = (float(((a - a.mean()) ** 2).sum()) + float(((b - b.mean()) ** 2).sum())) / (2 * n - 2)
        cell_sd, drift_sd = math.sqrt(cell_var), math.sqrt(max(pooled - cell_var, 0.0))
        cells = (rng.normal(0.0, drift_sd, size=(draws, 1, n))  # [draw, mode (like-best, off, fixed), repeat]
                 + rng.normal(0.0, cell_sd, size=(draws, 3, n)))
        middle = np.sort(cells, axis=2)[:, :, (n - 1) // 2]  # each mode's median run (`median_row`)
        p_median = float(np.mean(np.exp(middle[:, 0] - middle[:, 1:].max(axis=1)) >= floor))
        paired = np.median(np.exp(cells[:, 0] - cells[:, 1:].max(axis=1)), axis=1)  # `paired_ratios`
        out[f"c{c}"] = {"cell_sd": cell_sd, "drift_sd": drift_sd, "repeats": n, "p_median": p_median,
                        "p_paired": float(np.mean(paired >= floor))}
    return out


# -- the load generator ---------------------------------------------------------------------
# aiohttp, as `vllm bench serve` uses: on a 2-core host the client shares the CPU with the
# server, and httpx's streaming cost 143-160 us of client CPU per streamed token against
# aiohttp's 50-69 (measured at 16 streams; c16 tok/s rose 8-29% with the same server).
async def _one(session: Any, url: str, model: str, prompt: str, temperature: float, cfg: ServeBenchConfig,
               headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    spec = chunk.get("specops") or {}
                    res.drafted = spec.get("drafted") or 0
                    res.accepted = spec.get("accepted") or 0
                    res.observed = bool(spec.get("canary") or spec.get("probe"))
                    res.fallen_back = spec.get("fallback_reason") == "policy_fallback"
        res.e2e_s = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage chunk"
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


async def run_cell(url: str, model: str, prompts: list[tuple[str, float]], concurrency: int, cfg: ServeBenchConfig,
                   on_done=None) -> tuple[list[RequestResult], float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def guarded(prompt: str, temperature: float) -> RequestResult:
            async with sem:
                out = await _one(session, url, model, prompt, temperature, cfg, headers)
            if on_done is not None:
                on_done()
            return out

        start = time.perf_counter()
        tasks = []
        for prompt, temperature in prompts:
            tasks.append(asyncio.create_task(guarded(prompt, temperature)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# -- modes through Redis ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchServeError(f"the server exited with code {proc.returncode}{_log_tail(proc)}")
        try:
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise BenchServeError(f"{url} not ready after {timeout_s:.0f}s{_log_tail(proc)}")


def _log_tail(proc: subprocess.Popen | None, lines: int = 5) -> str:
    """'; it said: ...' from the last lines of a started process's log (``proc.log_path``), so a
    bad --server-arg is named, not just an exit code."""
    path = getattr(proc, "log_path", None)
    if path is None or not Path(path).exists():
        return ""
    tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    return "; it said: " + " | ".join(line.strip() for line in tail if line.strip()) if tail else ""


def _expected(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What the server's ``/readyz`` shows per class once it applied ``settings`` (class -> EffectiveSettings)."""
    return {k: {"method": v.method, "gamma": v.gamma, "medusa_heads": v.medusa_heads, "fallback": v.fallback_active}
            for k, v in settings.items()}


def _apply_mode(store: Any, mode: str) -> dict[str, dict[str, Any]]:
    """Write the mode's effective settings (an operator action); returns what `_wait_settings` waits for."""
    from dataclasses import replace

    from specops.policies.rollout import effective_for

    rev = store.current_revision()
    if rev is None:
        raise BenchServeError("the server's Redis holds no current policy revision")
    settings = effective_for(store.get_revision(rev).policy, rev, time.time())
    if mode in ("off", TWIN):
        settings = {k: replace(v, method="off") for k, v in settings.items()}
    store.set_effective(settings, epoch=None, reason=f"bench serve: mode {mode}", replace=True, actor="bench")
    return _expected(settings)


def _restore_adaptive(store: Any, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One server: put back the settings the controller had when its last cell ended."""
    if not settings:
        raise BenchServeError("the server's Redis held no effective settings after the adaptive mode's cell")
    store.set_effective(settings, epoch=None, reason="bench serve: mode adaptive (the controller's settings back)",
                        replace=True, actor="bench")
    return _expected(settings)


def _wait_settings(url: str, expected: dict[str, Any], timeout_s: float = 30.0) -> None:
    """Until ``/readyz`` shows ``expected``: class -> method, or class -> the fields `_expected` lists."""
    def shows(live: dict[str, Any], want: Any) -> bool:
        if isinstance(want, str):
            return live.get("method") == want
        return all(live.get(k) == v for k, v in want.items())

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        classes = _wait_ready(url, timeout_s)["policy"].get("classes", {})
        if all(shows(classes.get(k, {}), want) for k, want in expected.items()):
            return
        time.sleep(0.3)
    raise BenchServeError(f"the server did not apply the settings within {timeout_s:.0f}s")


def _pause(proc: subprocess.Popen | None) -> None:
    """One server: stop the adaptive mode's controller (SIGSTOP) while other modes hold the server."""
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGSTOP)


def _resume(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # a paused controller (`_pause`) would not act on SIGTERM
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


def _start_controller(cfg: ServeBenchConfig, redis_url: str, workdir: Path,
                      namespace: str | None = None, paused: bool = False) -> subprocess.Popen:
    """``specops controller run`` against ``namespace``; ``paused``: it will be stopped (`_pause`) between
    its mode's cells, for longer than a 15 s lease, so its lease lasts 10 minutes (it is the only
    controller there: nobody else could take the lead meanwhile)."""
    argv = [sys.executable, "-m", "specops.cli", "controller", "run", "--redis", redis_url, "--namespace",
            namespace or cfg.namespace, "--interval", str(cfg.controller_interval_s), "--window",
            str(cfg.window_s), "--listen", f"127.0.0.1:{_free_port()}",
            "--lease-ttl-ms", str(int(max(600_000 if paused else 15_000, 4000 * cfg.controller_interval_s)))]
    env = dict(os.environ, SPECOPS_WEBHOOK_TOKEN=secrets.token_hex(16))
    log = open(workdir / "controller.log", "wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _start_server(cfg: ServeBenchConfig, redis_url: str, workdir: Path, max_batch: int,
                  namespace: str | None = None, name: str = "serve") -> tuple[subprocess.Popen, str]:
    port = _free_port()
    argv = [sys.executable, "-m", "specops.cli", "serve", "--port", str(port), "--redis", redis_url,
            "--namespace", namespace or cfg.namespace, "--max-batch", str(max_batch), "--log-level", "warning", *cfg.server_args]
    log_path = workdir / f"{name}.log"
    run_dir = workdir / name
    run_dir.mkdir(exist_ok=True)
    proc = subprocess.Popen(argv, cwd=run_dir, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    proc.log_path = log_path  # type: ignore[attr-defined]  # read by _wait_ready on failure
    return proc, f"http://127.0.0.1:{port}"


def _settings_text(url: str) -> dict[str, str]:
    """Each class's live setting as the server reports it (``/readyz``), e.g. ``draft γ8``."""
    out = {}
    for name, c in sorted(_wait_ready(url, 30)["policy"].get("classes", {}).items()):
        text = c.get("method") or "?"
        if c.get("fallback"):
            text += " (fallback)"
        elif text == "medusa" and c.get("medusa_heads"):
            text += f" h{c['medusa_heads']}"
        elif text not in ("off", "ar") and c.get("gamma"):
            text += f" γ{c['gamma']}"
        out[name] = text
    return out


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
    leaves behind for the next one fell on one mode: in session 32, off-twin (set exactly like
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
    in one run (``--twin``, session 25), more than the goals' margins.
    """
    import redis as redis_lib

    from specops.policies.errors import StateError, StoreUnavailableError
    from specops.policies.redis_backend import close, connect
    from specops.policies.store import PolicyStore

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
    try:
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
            proc, url = _start_server(cfg, redis_url, workdir, max(cfg.concurrency), cfg.namespace)
            servers.append(proc)
            _wait_ready(url, 600, proc)
            store = PolicyStore(client, namespace=cfg.namespace)
            targets = {m: _Target(m, url, store, cfg.namespace) for m in modes}
        else:
            targets = {}
            for mode in modes:
                ns = f"{cfg.namespace}-{mode}"
                proc, url = _start_server(cfg, redis_url, workdir, max(cfg.concurrency), ns, name=f"serve-{mode}")
                servers.append(proc)
                targets[mode] = _Target(mode, url, PolicyStore(client, namespace=ns), ns)
            for proc, t in zip(servers, targets.values()):
                _wait_ready(t.url, 600, proc)
        first = next(iter(targets.values()))
        model = _wait_ready(first.url, 60).get("model", "bundled")
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
            expected = _apply_mode(t.store, t.mode)
            _wait_settings(t.url, expected)
            started = (_start_controller(cfg, redis_url, workdir, t.namespace, paused=not cfg.base_url)
                       if t.mode == "adaptive" else None)
            warm = tags.fresh(build_prompts(cfg, max(cfg.warmup, 1)))
            asyncio.run(run_cell(t.url, model, warm, min(len(warm), max(cfg.concurrency)), cfg))
            if traffic:
                _adaptive_warmup(t.url, model, cfg, tags)
            return started

        def measure(t: _Target, c: int) -> None:
            before = planner_counts(t.url)
            results, duration = asyncio.run(run_cell(t.url, model, tags.fresh(build_prompts(cfg, counts[c])), c, cfg,
                                                     on_done=on_done))
            row = summarize(t.mode, c, results, duration, cfg)
            row["prompts"] = cfg.prompts_label
            row["settings"] = _settings_text(t.url)  # at the cell's end (adaptive: what the controller chose)
            after = planner_counts(t.url)
            row.update(planner_delta(before, after))
            row.update(cpu_delta(before, after, row["output_tokens"]))
            runs[(t.mode, c)].append(row)

        if cfg.base_url:
            for mode in modes:
                controller = prepare(targets[mode], traffic=mode == "adaptive")
                for _ in range(cfg.repeats):
                    for c in cfg.concurrency:
                        measure(targets[mode], c)
                if controller is not None:
                    _stop(controller)
                    controller = None
        elif cfg.one_server:
            # warmed once, in the adaptive mode when measured (its controller acts on the warm-up), then
            # paused with its settings kept; every cell sets its mode, settles, and is measured (on `store`,
            # the one server's, from above)
            controller = prepare(targets["adaptive" if "adaptive" in modes else modes[0]], traffic=True)
            _pause(controller)
            kept = store.effective()
            for r in range(cfg.repeats):
                for j, c in enumerate(cfg.concurrency):
                    for mode in cell_order(modes, r, j):
                        t = targets[mode]
                        adaptive = t.mode == "adaptive"
                        _wait_settings(t.url, _restore_adaptive(store, kept) if adaptive else _apply_mode(store, t.mode))
                        _settle(t.url, model, cfg, c, build_prompts(cfg, counts[c]), tags)
                        if adaptive:
                            _resume(controller)
                        measure(t, c)
                        if adaptive:
                            _pause(controller)
                            kept = store.effective()
        else:
            # the controller acts on its server's warm-up, then is paused but for the adaptive cells:
            # it runs on the same host's CPUs as the other servers, and would otherwise keep adapting
            # (and spending them) while they are measured
            for t in targets.values():
                started = prepare(t, traffic=True)
                if started is not None:
                    controller = started
                    _pause(controller)
            for r in range(cfg.repeats):
                for j, c in enumerate(cfg.concurrency):  # the cells compared with each other back to back
                    for mode in cell_order(modes, r, j):
                        adaptive = mode == "adaptive"
                        if adaptive:
                            _resume(controller)
                        measure(targets[mode], c)
                        if adaptive:
                            _pause(controller)
        rows = [median_row(runs[(m, c)]) for m in modes for c in cfg.concurrency]
        cfg_out = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        cfg_out["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
        cfg_out["interleaved"] = not cfg.base_url
        cfg_out["settle_s"] = cfg.settle_seconds if cfg.one_server else None
        cfg_out["prompts"] = cfg.prompts_label
        report = {"config": cfg_out, "model": model, "results": rows}
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
            _stop(controller)
        for proc in servers:
            _stop(proc)
        if client is not None:
            client.close()
        if embedded is not None:
            embedded.connection_pool.disconnect()  # idle pooled connections would count as other users
            close(embedded)


PLANNER_SERIES = {("specops_serving_decode_steps", "kind"): ("spec", "plain"),
                  ("specops_serving_planner_events", "event"): ("veto", "probe", "plain_probe")}


CPU_SERIES = "process_cpu_seconds"  # prometheus_client's process collector (specops serve, vLLM, SGLang)
PREFIX_SERIES = "specops_serving_prefix_cache_hit_blocks"  # since the server started


def planner_counts(url: str) -> dict[str, float] | None:
    """The speculation planner's counters from a `specops serve` ``/metrics``, and the server
    process's CPU seconds (``cpu_s``, where it exports ``process_cpu_seconds_total``); None when
    the scrape fails or finds neither (`planner_delta` and `cpu_delta` read what is there)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{url}/metrics", timeout=10)
        r.raise_for_status()
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
    except (httpx.HTTPError, ValueError):
        return None
    out: dict[str, float] = {}
    for (name, label), values in PLANNER_SERIES.items():
        family = families.get(name)
        for sample in family.samples if family is not None else ():
            if sample.labels.get(label) in values:
                out[sample.labels[label]] = sample.value
    for family in (families.get(CPU_SERIES), families.get(CPU_SERIES + "_total")):  # as typed, or untyped
        for sample in family.samples if family is not None else ():
            if sample.name == CPU_SERIES + "_total":
                out["cpu_s"] = sample.value
    family = families.get(PREFIX_SERIES)
    for sample in family.samples if family is not None else ():
        out["prefix_hits"] = sample.value
    return out or None


def planner_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """A cell's share of decode steps that speculated, and the planner's vetoes and probes in it."""
    if before is None or after is None or not {"spec", "plain"} <= (before.keys() & after.keys()):
        return {"spec_step_share": None, "vetoes": None, "probes": None, "decode_steps": None,
                "prefix_hit_blocks": None}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d["spec"] + d["plain"]
    return {"spec_step_share": d["spec"] / steps if steps > 0 else None, "vetoes": int(d.get("veto", 0)),
            "probes": int(d.get("probe", 0) + d.get("plain_probe", 0)),
            "decode_steps": int(steps), "prefix_hit_blocks": int(d["prefix_hits"]) if "prefix_hits" in d else None}


def cpu_delta(before: dict[str, float] | None, after: dict[str, float] | None, tokens: int) -> dict[str, Any]:
    """The server process's CPU seconds in a cell (``server_cpu_s``) and per output token, in ms
    (``server_cpu_ms_per_token``): what a token cost the host's CPUs, beside what it cost in time.
    It is not steadier than tokens/s on a noisy host: on the 2-core CI host both moved by 10-15%
    between repeats of one cell, the CPU per token up where tokens/s went down (a slower moment
    costs more CPU per token too). It counts every thread of the process, those that spin while
    they wait for work included: at concurrency 1, `off` used ~3 ms of CPU per token at ~2.1 ms
    of wall time per token."""
    if before is None or after is None or "cpu_s" not in before or "cpu_s" not in after:
        return {"server_cpu_s": None, "server_cpu_ms_per_token": None}
    spent = max(after["cpu_s"] - before["cpu_s"], 0.0)
    return {"server_cpu_s": spent, "server_cpu_ms_per_token": 1000.0 * spent / tokens if tokens > 0 else None}


def _traffic(url: str, model: str, cfg: ServeBenchConfig, seconds: float, concurrencies: list[int],
             pool: list[tuple[str, float]], tags: PromptTags) -> None:
    """Unmeasured traffic from ``pool`` (cycled), at each of ``concurrencies`` in turn, for ``seconds``;
    each batch as ``tags`` sends it (fresh: behind its own tag)."""
    deadline = time.monotonic() + seconds
    k = at = 0
    while time.monotonic() < deadline:
        c = concurrencies[k % len(concurrencies)]
        n = max(2 * c, 4)
        prompts = tags.fresh([pool[(at + i) % len(pool)] for i in range(n)])
        asyncio.run(run_cell(url, model, prompts, c, cfg))
        k, at = k + 1, at + n


def _adaptive_warmup(url: str, model: str, cfg: ServeBenchConfig, tags: PromptTags) -> None:
    """Traffic of the same mix (other draws), cycling through the measured concurrencies,
    for ``adaptive_warmup_s``: the controller decides from telemetry windows and its alert
    rules wait ``for_s`` (30-60 s in the default policy), so an idle pause would measure
    the initial settings, not what the controller makes of them."""
    from dataclasses import replace

    pool = build_prompts(replace(cfg, seed=cfg.seed + 1000), 512)  # other draws than the measured cells
    _traffic(url, model, cfg, cfg.adaptive_warmup_s, cfg.concurrency, pool, tags)


def _settle(url: str, model: str, cfg: ServeBenchConfig, concurrency: int, prompts: list[tuple[str, float]],
           tags: PromptTags) -> None:
    """One server: ``settle_seconds`` of the cell's prompts at its concurrency under the mode just
    set, before the cell; for the adaptive mode with its controller still paused, so that its
    first window after resuming holds only requests served under its own settings. Fresh
    (`PromptTags`), each settle batch has its own tag, so the cell that follows finds none of its
    prompts in the prefix cache; warm, they are the cell's own texts and it finds them all
    (TTFT at c16 p50 27 ms warm against 59 ms once the cache had lost them, in every mode alike)."""
    _traffic(url, model, cfg, cfg.settle_seconds, [concurrency], prompts, tags)


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def emit_report(report: dict[str, Any], table: str, json_path: Path | None, plot_path: Path | None = None,
                plot=None) -> None:
    """Print a bench command's table, then write its JSON and plot where asked."""
    click.echo(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path and plot is not None:
        plot(report, plot_path)
        click.echo(f"wrote {plot_path}")


def format_table(report: dict[str, Any]) -> str:
    head = (f"{'mode':<9}{'conc':>5}{'req':>5}{'err':>4}{'tok/s':>9}{'req/s':>7}{'TTFT p50':>10}{'p99':>8}"
            f"{'TPOT p50':>10}{'p99':>8}{'ITL p99':>9}{'E2E p99':>9}{'goodput':>9}{'accept':>8}{'spec%':>7}"
            f"{'veto':>5}{'obs':>5}{'cpu ms/tok':>11}")
    lines = [head, "  (latencies in ms)"]
    prompts = report.get("config", {}).get("prompts")
    if prompts == "fresh":
        lines.insert(0, "prompts: fresh (each cell and each batch of warm-up / settle traffic behind its own tag: no "
                        "cell finds another's prompts in the prefix cache)")
    elif prompts == "warm":
        lines.insert(0, "prompts: warm (--warm-prefix: every repeat and the settle traffic replay the cell's "
                        "prompts, so TTFT and tok/s are of a warm prefix cache)")
    for r in report["results"]:
        lines.append(f"{r['mode']:<9}{r['concurrency']:>5}{r['requests']:>5}{r['errors']:>4}"
                     f"{r['output_tokens_per_s']:>9.1f}{r['requests_per_s']:>7.2f}"
                     f"{_fmt(r['ttft_p50_s'], 1000):>10}{_fmt(r['ttft_p99_s'], 1000):>8}"
                     f"{_fmt(r['tpot_p50_s'], 1000):>10}{_fmt(r['tpot_p99_s'], 1000):>8}"
                     f"{_fmt(r['itl_p99_s'], 1000):>9}{_fmt(r['e2e_p99_s'], 1000):>9}{r['goodput_rps']:>9.2f}"
                     f"{_fmt(r['acceptance_rate'], 1, 2):>8}{_fmt(r.get('spec_step_share'), 100, 0):>7}"
                     f"{_fmt(r.get('vetoes'), 1, 0):>5}{_fmt(r.get('observed_requests'), 1, 0):>5}"
                     f"{_fmt(r.get('server_cpu_ms_per_token'), 1, 3):>11}")
    if any(r.get("spec_step_share") is not None for r in report["results"]):
        lines.append("  (spec%: the cell's decode steps where some sequence speculated; veto: times the planner "
                     "stopped speculating at a batch size where it measured it slower)")
    if any(r.get("observed_requests") for r in report["results"]):
        lines.append("  (obs: the cell's canary and fallback-probe requests, which speculate as their setting says "
                     "whatever the planner measures)")
    if any(r.get("server_cpu_ms_per_token") is not None for r in report["results"]):
        lines.append("  (cpu ms/tok: the server process's CPU ms per output token in the cell, from its "
                     "process_cpu_seconds_total; with repeats, the median over them)")
    config = report.get("config", {})
    if config.get("one_server"):
        lines.append("  (one server for every mode: its settings switched through Redis before each cell, then "
                     f"{config.get('settle_s') or 0:g} s of unmeasured traffic in that mode)")
    if any(r.get("repeats", 1) > 1 for r in report["results"]):
        lines.append(f"  (each row: the median of {report['results'][0]['repeats']} runs by tok/s; "
                     "all runs' tok/s in the JSON)")
    ratios = goal_ratios(report)
    if ratios:
        lines.append("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    paired = paired_ratios(report)
    if paired:
        lines.append("paired (each repeat's ratio, median over repeats): "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in paired.items()))
        ranges = paired_ranges(report)
        lines.append("paired range (lowest-highest repeat): "
                     + ", ".join(f"{k} {lo:.2f}-{hi:.2f}x" for k, (lo, hi) in ranges.items()))
    resolution = goal_resolution(report)
    if resolution:
        lines.append(f"resolution of adaptive / max(off, fixed) >= {GOAL_FLOOR:g} (simulated runs of a mode exactly "
                     "like the better of off and fixed, cells varying as this run's off and fixed did): "
                     + ", ".join(f"{c} passes in {100 * v['p_median']:.0f}% (paired {100 * v['p_paired']:.0f}%; "
                                 f"cell sd {100 * v['cell_sd']:.1f}%, drift sd {100 * v['drift_sd']:.1f}%)"
                                 for c, v in resolution.items()))
    for c, split in (report.get("classes") or {}).items():
        total = sum(split.values())
        lines.append(f"c{c} cell's requests by class (policy {report.get('policy_version')}): "
                     + " · ".join(f"{name} {n}" for name, n in split.items()) + f" of {total}")
    for r in report["results"]:
        if r["mode"] == "adaptive" and r.get("settings"):
            lines.append(f"adaptive c{r['concurrency']} settings at the end of its run: "
                         + ", ".join(f"{k} {v}" for k, v in r["settings"].items()))
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Two panels: output tokens/s and p99 TPOT against concurrency, one line per mode
    (the rows: with repeats, the median run); with repeats, every run's tokens/s as a faint
    dot beside its mode's point (each mode a little to one side), so the spread that the
    ratios between modes carry is in the picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(r["mode"] for r in report["results"]))
    for i, mode in enumerate(modes):
        rows = [r for r in report["results"] if r["mode"] == mode]
        xs = [r["concurrency"] for r in rows]
        line, = left.plot(xs, [r["output_tokens_per_s"] for r in rows], marker="o", label=mode)
        right.plot(xs, [(r["tpot_p99_s"] or 0) * 1000 for r in rows], marker="o", label=mode)
        shift = 2 ** (0.06 * (i - (len(modes) - 1) / 2))  # side by side on the log axis
        for r in rows:
            runs = r.get("output_tokens_per_s_runs") or []
            if len(runs) > 1:
                left.scatter([r["concurrency"] * shift] * len(runs), runs, s=14, alpha=0.5,
                             color=line.get_color(), linewidths=0)
    repeats = max((len(r.get("output_tokens_per_s_runs") or []) for r in report["results"]), default=0)
    spread = f" (line: median run; dots: each of {repeats} runs)" if repeats > 1 else ""
    for ax, title in ((left, "output tokens/s" + spread), (right, "p99 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command("serve")
@click.option("--base-url", default=None, help="A running server (default: start one on the bundled models).")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="The server's Redis (required with --base-url; default: an embedded one for the started server).")
@click.option("--namespace", default="specops", show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated: off,fixed,adaptive.")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated max concurrencies.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help=f"Requests per cell (default {REQUESTS_PER_SLOT} x conc, >= {MIN_CELL_REQUESTS}; from "
                   f"concurrency 2 on >= min(32 x conc, {BATCHED_CELL_REQUESTS})).")
@click.option("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: all at once).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--mix", default="code:0.5,prose:0.3,hot:0.2", show_default=True)
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL with 'prompt' (and 'temperature') or one prompt per line; replaces --mix.")
@click.option("--slo", default=None, help="Goodput SLO, e.g. ttft:500,tpot:50 (milliseconds).")
@click.option("--api-key-env", default=None, metavar="VAR", help="Send the key in this environment variable.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--adaptive-warmup-s", type=click.FloatRange(min=0), default=45.0, show_default=True,
              help="Seconds of the same traffic before measuring, so the controller has acted (with started "
                   "servers every mode's server gets it, so all are measured after the same history).")
@click.option("--server-arg", "server_args", multiple=True,
              help="Extra argument for the started server (repeatable; it runs in a scratch folder, so give "
                   "file paths absolute).")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs of every cell; each row is the median run (use 3 or more for a claim).")
@click.option("--twin", is_flag=True,
              help=f"Also start a second server measured as off ({TWIN}) and report {TWIN} / off: how far two "
                   "identical server processes differ in this run, the noise floor of the mode ratios "
                   "(started servers only; with --one-server a fourth mode set like off on the one server).")
@click.option("--one-server", is_flag=True,
              help="One started server for every mode: each cell switches its settings through Redis, sends "
                   "--settle-s of unmeasured traffic, then measures (the controller paused outside adaptive "
                   "cells). The ratios then compare modes within one process.")
@click.option("--settle-s", type=click.FloatRange(min=0), default=None,
              help="With --one-server: seconds of traffic in a cell's mode before measuring it (default: the "
                   "controller's window, 5 x its 2 s interval).")
@click.option("--warm-prefix", is_flag=True,
              help="Replay the same prompt texts in every repeat and in the settle traffic, so cells find them in "
                   "the server's prefix cache (default: fresh, each cell's prompts behind a tag line of its own; "
                   "the table and JSON say which).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_serve_command(base_url, redis_url, namespace, modes, concurrency, num_prompts, request_rate, max_tokens, mix,
                        prompts_file, slo, api_key_env, json_path, plot_path, seed, adaptive_warmup_s, server_args,
                        repeats, twin, one_server, settle_s, warm_prefix, quiet) -> None:
    """Benchmark a specops server over HTTP: off / fixed / adaptive at several concurrencies."""
    try:
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        bad = [m for m in mode_list if m not in MODES]
        if bad or not mode_list:
            raise ValueError(f"--modes must be drawn from {', '.join(MODES)}, got {modes!r}")
        conc = [int(c) for c in concurrency.split(",") if c.strip()]
        if not conc or min(conc) < 1:
            raise ValueError("--concurrency wants positive integers")
        if not request_rate > 0:
            raise ValueError("--request-rate must be > 0")
        ttft, tpot = parse_slo(slo) if slo else (None, None)
        mix_weights = parse_mix(mix)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    api_key = os.environ.get(api_key_env, "").strip() if api_key_env else None
    cfg = ServeBenchConfig(base_url=base_url, redis_url=redis_url, namespace=namespace, modes=mode_list,
                           concurrency=conc, num_prompts=num_prompts, request_rate=request_rate, max_tokens=max_tokens,
                           mix=mix_weights, prompts_file=prompts_file, slo_ttft_s=ttft, slo_tpot_s=tpot,
                           api_key=api_key, seed=seed, server_args=list(server_args), progress=not quiet,
                           adaptive_warmup_s=adaptive_warmup_s, repeats=repeats, twin=twin, one_server=one_server,
                           settle_s=settle_s, warm_prefix=warm_prefix)
    try:
        report = run_bench_serve(cfg)
    except BenchServeError as exc:
        raise click.ClickException(str(exc)) from None
    emit_report(report, format_table(report), json_path, plot_path, plot_report)
