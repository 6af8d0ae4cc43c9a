"""What ``specops bench serve`` reads from a server's ``/metrics`` per cell: the speculation planner's
counters, the prefix cache's hits and the server process's CPU seconds."""

from __future__ import annotations

from typing import Any

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
