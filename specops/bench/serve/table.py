"""The results table of ``specops bench serve`` (and how a bench command prints and writes its report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from specops.bench.serve.stats import GOAL_FLOOR, goal_ratios, goal_resolution, paired_ranges, paired_ratios


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
    if report.get("config", {}).get("suite") == "chat":
        lines.insert(0, "suite: chat (the chat-model suites' conversations to /v1/chat/completions, labelled by class)")
    model, target = report.get("model"), report.get("model_target")
    if target:
        lines.insert(len(lines) - 2, f"model: {model} (--model {target['name']}, served alone; "
                                     + ", ".join(f"{c} {m}" for c, m in target["methods"].items())
                                     + (f"; EAGLE drafter {target['eagle']})" if target.get("eagle") else ")"))
    elif model:
        lines.insert(len(lines) - 2, f"model: {model}")
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
