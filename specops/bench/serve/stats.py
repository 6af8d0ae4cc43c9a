"""The figures of ``specops bench serve``: a cell's summary, the median of its repeats, and the ratios
the serving goals are stated in (of the medians, paired per repeat, and the goal's resolution)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from specops.bench.serve.config import TWIN, RequestResult, ServeBenchConfig


def median_known(values: list[float | None]) -> float | None:
    """The median of the values that are known (None: none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


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
