"""``specops bench serve``: option parsing and the per-cell figures (the live run is in test_openai_server)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from specops.bench.serve import RequestResult, ServeBenchConfig, build_prompts, parse_mix, parse_slo, summarize

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "examples" / "policies" / "default.yaml"


def fake_policy_store(monkeypatch, make) -> None:
    """The bench's `PolicyStore` replaced by ``make(client, namespace)`` for one test. Every module
    that binds the real class by name at import is imported first: one first imported while the
    fake is in place would keep the fake for the rest of the run."""
    import importlib

    for name in ("specops.policies.cli", "specops.policies.rollout", "specops.policies.audit_log",
                 "specops.policies.class_status", "specops.policies.status_view", "specops.controller.simulator",
                 "specops.controller.dry_run"):
        importlib.import_module(name)
    monkeypatch.setattr("specops.policies.store.PolicyStore", make)


class FakeProc:
    """A started server or controller as the orchestration sees it: never exits."""

    pid = None  # never a signal target: os.kill(None, ...) raises where 0 would hit this process group

    def __init__(self, name: str = "") -> None:
        self.name = name

    def poll(self):
        return None


def recording_starter(started: list, url: str | None = None):
    """A `_start_server` that records each namespace and returns a FakeProc and ``url`` (default
    ``http://NAMESPACE``)."""
    def start_server(cfg, redis_url, workdir, max_batch, namespace=None, name="serve"):
        started.append(namespace)
        return FakeProc(name), url or f"http://{namespace}"
    return start_server


def test_parse_mix_and_slo():
    assert parse_mix("code:0.5,prose:0.3,hot:0.2") == {"code": 0.5, "prose": 0.3, "hot": 0.2}
    for bad in ("code", "poetry:1", "code:x", "code:-1", "code:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    assert parse_slo("ttft:500,tpot:50") == (0.5, 0.05)
    assert parse_slo("tpot:20") == (None, 0.02)
    for bad in ("ttft", "e2e:5", "ttft:0", "tpot:abc"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_summary_figures_and_goodput():
    cfg = ServeBenchConfig(slo_ttft_s=0.2, slo_tpot_s=0.05)
    results = [
        RequestResult(ok=True, ttft_s=0.1, e2e_s=0.1 + 9 * 0.04, output_tokens=10, itl_s=[0.04] * 9, drafted=10,
                      accepted=5),                                    # meets both SLOs
        RequestResult(ok=True, ttft_s=0.3, e2e_s=0.3 + 9 * 0.02, output_tokens=10, itl_s=[0.02] * 9),  # TTFT miss
        RequestResult(ok=True, ttft_s=0.1, e2e_s=0.1 + 9 * 0.1, output_tokens=10, itl_s=[0.1] * 9),    # TPOT miss
        RequestResult(ok=False, error="HTTP 429"),
    ]
    row = summarize("fixed", 4, results, 2.0, cfg)
    assert row["requests"] == 4 and row["errors"] == 1
    assert row["output_tokens_per_s"] == pytest.approx(15.0) and row["requests_per_s"] == pytest.approx(1.5)
    assert row["goodput_rps"] == pytest.approx(0.5)
    assert row["tpot_p50_s"] == pytest.approx(0.04) and row["tpot_p99_s"] == pytest.approx(0.0988, rel=1e-3)
    assert row["ttft_p50_s"] == pytest.approx(0.1) and row["acceptance_rate"] == pytest.approx(0.5)
    assert row["error_samples"] == ["HTTP 429"]
    assert (row["observed_requests"], row["fallen_back_requests"]) == (0, 0)
    probe = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=10, observed=True)
    plain = RequestResult(ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=10, fallen_back=True)
    row = summarize("adaptive", 4, [probe, plain, plain, RequestResult(ok=False, observed=True)], 2.0, cfg)
    assert (row["observed_requests"], row["fallen_back_requests"]) == (1, 2)  # of the requests that finished
    for key in ("mode", "concurrency", "requests", "errors", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                "tpot_p50_s", "tpot_p99_s", "itl_p99_s", "goodput_rps"):
        assert key in row


def test_default_cells_last_alike_at_every_concurrency():
    """48 requests at c1 (~14 s on the bundled models); from c2 on 32 per slot up to 128, so the c4
    cell is no longer a third as long as the others; 8 per slot beyond that."""
    from specops.bench.serve import cell_requests

    assert [cell_requests(c) for c in (1, 2, 4, 8, 16, 32)] == [48, 64, 128, 128, 128, 256]


def test_prompts_follow_the_mix_and_repeat_across_modes():
    cfg = ServeBenchConfig(mix={"code": 1.0, "hot": 1.0}, seed=3)
    a, b = build_prompts(cfg, 40), build_prompts(cfg, 40)
    assert a == b  # every mode gets the same requests
    hot = sum(1 for _, t in a if t > 0)
    assert 8 <= hot <= 32 and all(t in (0.0, 1.0) for _, t in a)
    assert math.isinf(ServeBenchConfig().request_rate)


def test_adaptive_warmup_sends_the_mix_at_every_concurrency_until_its_time_is_up(monkeypatch):
    """adaptive is measured after --adaptive-warmup-s of traffic (not an idle pause): cells of
    the same mix, other draws, cycling through the measured concurrencies, bounded in time."""
    import time

    from specops.bench import serve

    calls = []

    async def fake_cell(url, model, prompts, concurrency, cfg, on_done=None):
        calls.append((concurrency, len(prompts), prompts[0], time.monotonic()))
        time.sleep(0.02)
        return [], 0.02

    monkeypatch.setattr(serve.load, "run_cell", fake_cell)
    cfg = serve.ServeBenchConfig(concurrency=[1, 4], adaptive_warmup_s=0.2)
    serve._adaptive_warmup("http://x", "bundled", cfg, serve.PromptTags(warm=False))
    assert calls[-1][3] - calls[0][3] < 0.2 + 0.05  # no cell starts after the time is up
    assert len(calls) >= 4
    assert [c[0] for c in calls[:4]] == [1, 4, 1, 4]
    assert all(n == max(2 * c, 4) for c, n, _, _ in calls)
    assert len({c[2] for c in calls}) > 1  # other draws each cell


def test_a_started_server_that_exits_is_reported_with_what_it_said(tmp_path):
    """A bad --server-arg ends in one line naming the server's own error, not a bare exit code."""
    import subprocess
    import sys

    from specops.bench import serve

    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('Error: No such option --bogus'); sys.exit(2)"],
                                stdout=out, stderr=subprocess.STDOUT)
    proc.log_path = log
    proc.wait(30)
    with pytest.raises(serve.BenchServeError, match="code 2; it said: Error: No such option --bogus"):
        serve._wait_ready("http://127.0.0.1:9", 5, proc)


def test_repeats_report_the_median_run_and_the_goal_ratios():
    from specops.bench.serve import format_table, goal_ratios, median_row

    def row(mode, c, tps, ttft):
        return {"mode": mode, "concurrency": c, "requests": 8, "errors": 0, "output_tokens_per_s": tps,
                "requests_per_s": 1.0, "ttft_p50_s": ttft, "ttft_p99_s": ttft, "tpot_p50_s": 0.002,
                "tpot_p99_s": 0.003, "itl_p99_s": 0.004, "e2e_p99_s": 0.2, "goodput_rps": 1.0, "acceptance_rate": None}

    runs = [row("off", 1, 300.0, 0.03), row("off", 1, 100.0, 0.09), row("off", 1, 250.0, 0.01)]
    runs[1]["errors"] = 2
    med = median_row(runs)
    assert med["output_tokens_per_s"] == 250.0 and med["ttft_p50_s"] == 0.01  # the whole median run, not a mix
    assert med["output_tokens_per_s_runs"] == [300.0, 100.0, 250.0] and med["repeats"] == 3
    assert med["errors_all_runs"] == 2
    assert median_row(runs[:2])["output_tokens_per_s"] == 100.0  # an even count: the lower middle
    report = {"results": [med, dict(med, mode="off", concurrency=16, output_tokens_per_s=1000.0),
                          dict(med, mode="fixed", concurrency=1, output_tokens_per_s=350.0),
                          dict(med, mode="fixed", concurrency=16, output_tokens_per_s=900.0),
                          dict(med, mode="adaptive", concurrency=1, output_tokens_per_s=325.0),
                          dict(med, mode="adaptive", concurrency=16, output_tokens_per_s=990.0)]}
    ratios = goal_ratios(report)
    assert ratios["off c16 / off c1"] == pytest.approx(4.0)
    assert ratios["adaptive / off at c1"] == pytest.approx(1.3)
    assert ratios["adaptive / max(off, fixed) at c1"] == pytest.approx(325 / 350)
    assert ratios["adaptive / max(off, fixed) at c16"] == pytest.approx(0.99)
    table = format_table(report)
    assert "median of 3 runs" in table and "off c16 / off c1 4.00x" in table
    assert goal_ratios({"results": [dict(med, mode="fixed")]}) == {}  # nothing to compare: no ratio line


def test_a_started_bench_runs_one_server_per_mode_and_interleaves_the_modes_per_repeat(monkeypatch, tmp_path):
    """Each mode has its own server and namespace (the controller on the adaptive one), every
    server is warmed before measuring, and the modes' cells at one concurrency run back to back,
    in an order rotated by the repeat and the concurrency."""
    from specops.bench import serve

    started, measured, controllers = [], [], []

    async def cell(url, model, prompts, c, cfg, on_done=None):
        if on_done is not None:  # a measured cell (warm-ups pass no progress callback)
            measured.append((url.split("//")[1], c))
        return [serve.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, output_tokens=8)], 0.1

    monkeypatch.setattr(serve.procs, "_start_server", recording_starter(started))
    monkeypatch.setattr(serve.procs, "_start_controller",
                        lambda cfg, r, w, ns=None, paused=False: controllers.append(ns) or FakeProc("c"))
    monkeypatch.setattr(serve.procs, "_pause", lambda proc: None)
    monkeypatch.setattr(serve.procs, "_resume", lambda proc: None)
    monkeypatch.setattr(serve.procs, "_stop", lambda proc, timeout_s=20.0: None)
    monkeypatch.setattr(serve.procs, "_wait_ready", lambda url, timeout_s, proc=None: {"model": "m", "policy": {}})
    monkeypatch.setattr(serve.settings, "_apply_mode", lambda store, mode: {})
    monkeypatch.setattr(serve.settings, "_wait_settings", lambda url, expected, timeout_s=30.0: None)
    warmed = []
    monkeypatch.setattr(serve.load, "_adaptive_warmup", lambda url, model, cfg, tags: warmed.append(url.split("//")[1]))
    monkeypatch.setattr(serve.load, "run_cell", cell)
    scrapes = {}

    def planner_counts(url):  # each scrape of a server: 3 more speculative steps, 1 more plain step
        n = scrapes[url] = scrapes.get(url, 0) + 1
        return {"spec": 3.0 * n, "plain": 1.0 * n, "veto": 0.0, "probe": 0.0, "plain_probe": float(n), "cpu_s": 0.5 * n}

    monkeypatch.setattr(serve.scrape, "planner_counts", planner_counts)
    cfg = serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[1, 4], repeats=3, num_prompts=1,
                                 progress=True)
    report = serve.run_bench_serve(cfg)
    assert started == ["specops-off", "specops-fixed", "specops-adaptive"] and controllers == ["specops-adaptive"]
    # every mode's server gets the same warm-up traffic (only the adaptive one has a controller)
    assert warmed == ["specops-off", "specops-fixed", "specops-adaptive"]
    # per repeat and concurrency, every mode back to back, the order rotated by both and reversed in odd
    # repeats (`cell_order`)
    assert [(ns.split("-")[1], c) for ns, c in measured] == [
        ("off", 1), ("fixed", 1), ("adaptive", 1), ("fixed", 4), ("adaptive", 4), ("off", 4),  # repeat 0
        ("off", 1), ("adaptive", 1), ("fixed", 1), ("fixed", 4), ("off", 4), ("adaptive", 4),  # repeat 1
        ("adaptive", 1), ("off", 1), ("fixed", 1), ("off", 4), ("fixed", 4), ("adaptive", 4)]  # repeat 2
    assert [(r["mode"], r["concurrency"], r["repeats"]) for r in report["results"]] == [
        (m, c, 3) for m in ("off", "fixed", "adaptive") for c in (1, 4)]
    assert report["config"]["interleaved"] is True
    assert all((r["spec_step_share"], r["vetoes"], r["probes"]) == (0.75, 0, 1) for r in report["results"])
    # each cell: 0.5 CPU s between its two scrapes, over its one request's 8 tokens
    assert all(r["server_cpu_ms_per_token_runs"] == [62.5] * 3 for r in report["results"])


@pytest.mark.parametrize("modes", [["off"], ["off", "fixed"], ["off", "fixed", "adaptive"],
                                   ["off", "fixed", "adaptive", "off-twin"], list("abcde")])
def test_the_cell_order_puts_every_mode_behind_every_other_and_in_every_position_alike(modes):
    """A Williams design: over n repeats (2n for an odd number n of modes) each ordered pair of
    modes is adjacent equally often, and each mode holds each position equally often, whatever
    the concurrency's offset."""
    from collections import Counter

    from specops.bench.serve import cell_order

    n = len(modes)
    for index in range(3):
        pairs, places = Counter(), Counter()
        for r in range(n if n % 2 == 0 else 2 * n):
            order = cell_order(modes, r, index)
            assert sorted(order) == sorted(modes)
            places.update((m, i) for i, m in enumerate(order))
            pairs.update(zip(order, order[1:]))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
        assert len(places) == n * n and len(set(places.values())) == 1


def test_twin_adds_a_second_off_server_and_its_ratio_to_off(monkeypatch):
    """--twin: a fourth started server set to off, warmed and interleaved like the others, its
    rows named off-twin, and off-twin / off among the ratios (the noise floor of the others)."""
    from specops.bench import serve

    started, applied, measured = [], [], []

    speed = {"specops-off": 100.0, "specops-fixed": 110.0, "specops-adaptive": 120.0, "specops-off-twin": 90.0}

    async def cell(url, model, prompts, c, cfg, on_done=None):
        ns = url.split("//")[1]
        if on_done is not None:
            measured.append(ns)
        n = 8 * len(prompts)
        return [serve.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, output_tokens=8)] * len(prompts), n / speed[ns]

    monkeypatch.setattr(serve.procs, "_start_server", recording_starter(started))
    monkeypatch.setattr(serve.procs, "_start_controller", lambda cfg, r, w, ns=None, paused=False: FakeProc())
    monkeypatch.setattr(serve.procs, "_pause", lambda proc: None)
    monkeypatch.setattr(serve.procs, "_resume", lambda proc: None)
    monkeypatch.setattr(serve.procs, "_stop", lambda proc, timeout_s=20.0: None)
    monkeypatch.setattr(serve.procs, "_wait_ready", lambda url, timeout_s, proc=None: {"model": "m", "policy": {}})
    monkeypatch.setattr(serve.settings, "_apply_mode", lambda store, mode: applied.append(mode) or {})
    monkeypatch.setattr(serve.settings, "_wait_settings", lambda url, expected, timeout_s=30.0: None)
    monkeypatch.setattr(serve.load, "_adaptive_warmup", lambda url, model, cfg, tags: None)
    monkeypatch.setattr(serve.load, "run_cell", cell)
    monkeypatch.setattr(serve.scrape, "planner_counts", lambda url: None)
    cfg = serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[16], repeats=2, num_prompts=2,
                                 progress=True, twin=True)  # (measured cells report progress; warm-ups do not)
    report = serve.run_bench_serve(cfg)
    assert started == ["specops-off", "specops-fixed", "specops-adaptive", "specops-off-twin"]
    assert applied == ["off", "fixed", "adaptive", "off-twin"]
    assert sorted(measured) == sorted(2 * list(speed))
    assert [r["mode"] for r in report["results"]] == ["off", "fixed", "adaptive", "off-twin"]
    assert report["ratios"]["off-twin / off at c16"] == pytest.approx(0.9)
    assert report["paired_ratios"]["off-twin / off at c16"] == pytest.approx(0.9)
    assert report["ratios"]["adaptive / max(off, fixed) at c16"] == pytest.approx(120 / 110)
    # the goal's ratio for a mode that decodes like off: what adaptive reads where nothing speculates
    assert report["ratios"]["off-twin / max(off, fixed) at c16"] == pytest.approx(90 / 110)
    assert report["paired_ratios"]["off-twin / max(off, fixed) at c16"] == pytest.approx(90 / 110)
    table = serve.format_table(report)
    assert "off-twin / off at c16 0.90x" in table and "\noff-twin    16" in table
    # the twin needs started servers and an off mode to compare with
    for bad in (dict(base_url="http://x"), dict(modes=["fixed", "adaptive"])):
        with pytest.raises(serve.BenchServeError, match="--twin"):
            serve.run_bench_serve(serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", twin=True, **bad))


def test_twin_applies_the_off_settings(monkeypatch):
    from specops.bench import serve

    class Store:
        def current_revision(self):
            return 1

        def get_revision(self, rev):
            from specops.policies import load_policy

            return type("R", (), {"policy": load_policy("version: v\ndefault_class: a\nclasses: [{name: a}]\n")})

        def set_effective(self, settings, **kw):
            self.settings = settings

    store = Store()
    methods = lambda expected: {k: v["method"] for k, v in expected.items()}  # noqa: E731
    assert methods(serve._apply_mode(store, "off-twin")) == {"a": "off"} == methods(serve._apply_mode(store, "off"))
    assert serve._apply_mode(store, "fixed") == {"a": {"method": "draft", "gamma": 4, "medusa_heads": 3,
                                                      "fallback": False}}


def test_one_server_serves_every_mode_switching_settings_settling_and_pausing_the_controller(monkeypatch):
    """--one-server: one started server and one controller; warmed in the adaptive mode, then each
    cell writes its mode (adaptive: the settings its controller left after its previous cell), waits
    for /readyz to show them, settles at the cell's concurrency, and is measured; the controller
    runs only during adaptive cells."""
    from specops.bench import serve

    events, started = [], []

    class Store:
        gamma = 6  # what the controller has set: it moves during each adaptive cell (below)

        def effective(self):
            events.append(("kept", self.gamma))
            return {"code": self.gamma}

        def current_policy(self):  # the bundled default: the report counts the cells' requests per class
            from specops.policies.loader import load_policy

            return load_policy(DEFAULT_POLICY)

    store = Store()
    fake_policy_store(monkeypatch, lambda client, namespace: store)
    monkeypatch.setattr(serve.procs, "_start_server", recording_starter(started, "http://one"))
    monkeypatch.setattr(serve.procs, "_start_controller",
                        lambda cfg, r, w, ns=None, paused=False: events.append(("controller", ns, paused)) or FakeProc())
    monkeypatch.setattr(serve.procs, "_stop", lambda proc, timeout_s=20.0: None)
    monkeypatch.setattr(serve.procs, "_pause", lambda proc: events.append("pause"))
    monkeypatch.setattr(serve.procs, "_resume", lambda proc: events.append("resume"))
    monkeypatch.setattr(serve.procs, "_wait_ready", lambda url, timeout_s, proc=None: {"model": "m", "policy": {}})
    monkeypatch.setattr(serve.settings, "_apply_mode",
                        lambda st, mode: events.append(("apply", mode)) or {"code": mode})
    monkeypatch.setattr(serve.settings, "_restore_adaptive",
                        lambda st, kept: events.append(("restore", kept["code"])) or {"code": kept["code"]})
    monkeypatch.setattr(serve.settings, "_wait_settings",
                        lambda url, expected, timeout_s=30.0: events.append(("wait", expected)))
    monkeypatch.setattr(serve.load, "_adaptive_warmup", lambda url, model, cfg, tags: events.append("warmup"))
    monkeypatch.setattr(serve.load, "_settle", lambda url, model, cfg, c, prompts, tags: events.append(("settle", c)))
    monkeypatch.setattr(serve.scrape, "planner_counts", lambda url: None)

    async def cell(url, model, prompts, c, cfg, on_done=None):
        if on_done is not None:  # a measured cell
            events.append(("measure", c))
            if events[-2] == "resume":  # the controller acts during its cell
                store.gamma += 1
        return [serve.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, output_tokens=8)], 0.1

    monkeypatch.setattr(serve.load, "run_cell", cell)
    cfg = serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[1, 4], repeats=1, num_prompts=1,
                                 one_server=True, settle_s=2.5)
    report = serve.run_bench_serve(cfg)
    assert started == ["specops"]
    assert events[:5] == [("apply", "adaptive"), ("wait", {"code": "adaptive"}), ("controller", "specops", True),
                          "warmup", "pause"]
    assert events[5:] == [
        ("kept", 6),
        ("apply", "off"), ("wait", {"code": "off"}), ("settle", 1), ("measure", 1),
        ("apply", "fixed"), ("wait", {"code": "fixed"}), ("settle", 1), ("measure", 1),
        ("restore", 6), ("wait", {"code": 6}), ("settle", 1), "resume", ("measure", 1), "pause", ("kept", 7),
        ("apply", "fixed"), ("wait", {"code": "fixed"}), ("settle", 4), ("measure", 4),
        ("restore", 7), ("wait", {"code": 7}), ("settle", 4), "resume", ("measure", 4), "pause", ("kept", 8),
        ("apply", "off"), ("wait", {"code": "off"}), ("settle", 4), ("measure", 4)]
    assert report["config"]["one_server"] is True and report["config"]["settle_s"] == 2.5
    assert report["config"]["interleaved"] is True and report["paired_ratios"]
    assert "then 2.5 s of unmeasured traffic in that mode" in serve.format_table(report)
    assert report["policy_version"] == "2026-12-04.1" and set(report["classes"]) == {"1", "4"}
    assert all(sum(split.values()) == 1 for split in report["classes"].values())  # --num-prompts 1
    assert "c4 cell's requests by class (policy 2026-12-04.1): sampled " in serve.format_table(report)
    # the settle time defaults to the started controller's window
    assert serve.ServeBenchConfig(one_server=True).settle_seconds == 10.0
    with pytest.raises(serve.BenchServeError, match="--one-server"):
        serve.run_bench_serve(serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", one_server=True,
                                                     base_url="http://x"))
    # --twin there: a fourth mode of the same server, written like off
    events.clear()
    report = serve.run_bench_serve(serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[16],
                                                          num_prompts=1, one_server=True, twin=True))
    assert started == ["specops", "specops"]
    assert [e[1] for e in events if e[0] == "apply"] == ["adaptive", "off", "fixed", "off-twin"]
    assert "off-twin / off at c16" in report["ratios"]
    with pytest.raises(serve.BenchServeError, match="add --one-server"):  # a settle time without it does nothing
        serve.run_bench_serve(serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", settle_s=3.0))


def test_wait_settings_waits_for_every_knob_not_only_the_method(monkeypatch):
    """Switching between modes with the same methods (fixed and adaptive) changes only γ: the
    wait has to see the new γ, or the cell's first requests run under the old one."""
    from specops.bench import serve

    old, new = ({"code": {"method": "draft", "gamma": g, "medusa_heads": 3, "fallback": False}} for g in (10, 6))
    polls = []  # the server shows the old γ twice, then the new one

    def ready(url, timeout_s, proc=None):
        polls.append(1)
        return {"policy": {"classes": old if len(polls) <= 2 else new}}

    monkeypatch.setattr(serve.procs, "_wait_ready", ready)
    monkeypatch.setattr(serve.settings.time, "sleep", lambda s: None)
    serve._wait_settings("http://x", {"code": {"method": "draft", "gamma": 6, "medusa_heads": 3, "fallback": False}})
    assert len(polls) == 3
    serve._wait_settings("http://x", {"code": "draft"})  # a method alone still works
    with pytest.raises(serve.BenchServeError, match="did not apply"):
        serve._wait_settings("http://x", {"code": {"gamma": 1}}, timeout_s=0.0)


def test_a_paused_controller_resumes_and_stops_at_once(tmp_path):
    """The one-server bench pauses its controller with SIGSTOP; `_stop` continues it first, so a
    paused controller acts on SIGTERM instead of waiting out the kill timeout."""
    import subprocess
    import sys
    import time

    from specops.bench import serve

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: E731
        serve._pause(proc)
        deadline = time.monotonic() + 5
        while state() != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state() == "T"  # stopped
        serve._resume(proc)
        serve._pause(proc)
        started = time.monotonic()
        serve._stop(proc, timeout_s=10.0)
        assert proc.returncode == -15 and time.monotonic() - started < 5.0  # SIGTERM, not the kill timeout
        serve._pause(proc)  # an exited process: nothing to do
        serve._resume(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_planner_delta_of_a_cell():
    from specops.bench.serve import planner_delta

    before = {"spec": 10.0, "plain": 30.0, "veto": 1.0, "probe": 2.0, "plain_probe": 0.0}
    after = {"spec": 40.0, "plain": 40.0, "veto": 3.0, "probe": 2.0, "plain_probe": 1.0}
    assert planner_delta(before, after) == {"spec_step_share": 0.75, "vetoes": 2, "probes": 1, "decode_steps": 40,
                                            "prefix_hit_blocks": None}
    assert planner_delta(None, after) == {"spec_step_share": None, "vetoes": None, "probes": None,
                                          "decode_steps": None, "prefix_hit_blocks": None}
    # the prefix cache's reused blocks in the cell, where the server exports them
    assert planner_delta(dict(before, prefix_hits=100.0), dict(after, prefix_hits=164.0))["prefix_hit_blocks"] == 64
    assert planner_delta(after, after)["spec_step_share"] is None  # no decode step in the cell


def test_the_cpu_per_token_of_a_cell_from_the_servers_process_counter(monkeypatch):
    """A cell's server CPU comes from ``process_cpu_seconds_total`` (any server that exports it,
    specops serve or vLLM); the planner's figures only where its counters are there too; with
    repeats the row carries every run's CPU per token and their median."""
    import httpx

    from specops.bench import serve

    planner = ('specops_serving_decode_steps{kind="spec"} 6.0\n'
               'specops_serving_decode_steps{kind="plain"} 2.0\n'
               '# TYPE specops_serving_prefix_cache_hit_blocks gauge\n'
               'specops_serving_prefix_cache_hit_blocks 17.0\n')
    texts = {"http://ours": "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
                            "# TYPE specops_serving_decode_steps gauge\n" + planner,
             "http://peer": "process_cpu_seconds_total 3.25\n",  # untyped
             "http://bare": "# TYPE up gauge\nup 1.0\n"}

    def get(url, timeout):
        base = url.rsplit("/metrics", 1)[0]
        return httpx.Response(200, text=texts[base], request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    ours, peer = serve.planner_counts("http://ours"), serve.planner_counts("http://peer")
    assert ours == {"spec": 6.0, "plain": 2.0, "cpu_s": 12.5, "prefix_hits": 17.0} and peer == {"cpu_s": 3.25}
    assert serve.planner_counts("http://bare") is None
    assert serve.planner_delta(peer, dict(peer, cpu_s=4.0))["spec_step_share"] is None  # no planner there
    assert serve.cpu_delta(peer, dict(peer, cpu_s=4.0), 500) == {"server_cpu_s": 0.75,
                                                                  "server_cpu_ms_per_token": pytest.approx(1.5)}
    assert serve.cpu_delta(None, peer, 500)["server_cpu_ms_per_token"] is None
    assert serve.cpu_delta({"spec": 1.0, "plain": 1.0}, ours, 500)["server_cpu_s"] is None  # no counter before
    assert serve.cpu_delta(peer, peer, 0)["server_cpu_ms_per_token"] is None  # no token in the cell

    def row(tps, cpu):
        return {"mode": "off", "concurrency": 4, "requests": 8, "errors": 0, "output_tokens_per_s": tps,
                "requests_per_s": 1.0, "ttft_p50_s": 0.01, "ttft_p99_s": 0.02, "tpot_p50_s": 0.002,
                "tpot_p99_s": 0.003, "itl_p99_s": 0.004, "e2e_p99_s": 0.2, "goodput_rps": 1.0,
                "acceptance_rate": None, "server_cpu_ms_per_token": cpu}

    med = serve.median_row([row(300.0, 1.0), row(100.0, 3.0), row(250.0, 1.5)])
    assert med["output_tokens_per_s"] == 250.0 and med["server_cpu_ms_per_token_runs"] == [1.0, 3.0, 1.5]
    assert med["server_cpu_ms_per_token"] == 1.5  # the median over the runs
    assert serve.median_row([row(300.0, None)])["server_cpu_ms_per_token"] is None
    table = serve.format_table({"results": [med]})
    assert "cpu ms/tok" in table and "1.500" in table and "process_cpu_seconds_total" in table


def test_paired_ratios_take_each_repeats_ratio_then_the_median():
    from specops.bench.serve import format_table, paired_ratios

    def row(mode, c, runs):
        return {"mode": mode, "concurrency": c, "requests": 8, "errors": 0, "output_tokens_per_s": sorted(runs)[1],
                "output_tokens_per_s_runs": runs, "repeats": 3, "requests_per_s": 1.0, "ttft_p50_s": 0.01,
                "ttft_p99_s": 0.01, "tpot_p50_s": 0.002, "tpot_p99_s": 0.003, "itl_p99_s": 0.004, "e2e_p99_s": 0.2,
                "goodput_rps": 1.0, "acceptance_rate": None}

    # the host ran fast in repeat 2: every mode's cell was faster there
    results = [row("off", 1, [200.0, 400.0, 210.0]), row("fixed", 1, [300.0, 560.0, 290.0]),
               row("adaptive", 1, [290.0, 600.0, 300.0]), row("off", 16, [900.0, 1700.0, 950.0])]
    report = {"config": {"interleaved": True}, "results": results}
    paired = paired_ratios(report)
    assert paired["adaptive / max(off, fixed) at c1"] == pytest.approx(300 / 290)  # of 0.967, 1.071, 1.034
    assert paired["adaptive / off at c1"] == pytest.approx(1.45)  # of 1.45, 1.5, 1.43
    assert paired["off c16 / off c1"] == pytest.approx(4.5)  # of 4.5, 4.25, 4.52
    assert "paired (each repeat's ratio" in format_table(report)
    from specops.bench.serve import paired_ranges

    lo, hi = paired_ranges(report)["adaptive / max(off, fixed) at c1"]
    assert (lo, hi) == (pytest.approx(290 / 300), pytest.approx(600 / 560))
    assert "paired range (lowest-highest repeat): " in format_table(report)
    assert paired_ratios({"config": {"interleaved": False}, "results": results}) == {}  # sequential: no pairs


def test_the_report_counts_each_cells_requests_per_class_of_the_servers_policy():
    """Where the mix lands decides what the modes compare: a default policy can put 39 of a
    c1 cell's 48 requests in `general`; this one splits them by temperature and code."""
    from specops.bench import serve
    from specops.policies.loader import load_policy

    policy = load_policy(DEFAULT_POLICY)
    cfg = serve.ServeBenchConfig()
    split = serve.mix_classes(policy, cfg, {1: 48, 16: 128})
    assert list(split) == ["1", "16"] and list(split["1"]) == ["sampled", "code", "factual", "general"]
    assert sum(split["1"].values()) == 48 and sum(split["16"].values()) == 128
    hot = sum(t > 0 for _, t in serve.build_prompts(cfg, 48))
    assert split["1"]["sampled"] == hot  # every temperature-1.0 request, whatever its text
    assert split["1"]["code"] >= 0.3 * 48 and split["1"]["general"] <= 0.4 * 48
    table = serve.format_table({"results": [], "classes": split, "policy_version": policy.version})
    assert f"c1 cell's requests by class (policy {policy.version}): sampled {hot} · code" in table
    assert table.endswith(" of 128")


def test_goal_resolution_is_how_often_a_mode_like_the_best_passes_at_this_runs_noise():
    """Cells that differ within each repeat leave the goal's 0.97 bound to chance for a mode
    equal to the better of off and fixed; drift that moves every mode of a repeat alike does
    not (the paired ratio cancels it, and the modes' medians move together)."""
    from specops.bench.serve import format_table, goal_resolution

    def row(mode, c, runs):
        return {"mode": mode, "concurrency": c, "requests": 8, "errors": 0, "output_tokens_per_s": sorted(runs)[(len(runs) - 1) // 2],
                "output_tokens_per_s_runs": runs, "repeats": len(runs), "requests_per_s": 1.0, "ttft_p50_s": 0.01,
                "ttft_p99_s": 0.01, "tpot_p50_s": 0.002, "tpot_p99_s": 0.003, "itl_p99_s": 0.004, "e2e_p99_s": 0.2,
                "goodput_rps": 1.0, "acceptance_rate": None}

    quiet = [1000.0, 1001.0, 999.0, 1000.0, 1000.5, 999.5]
    drift = [800.0, 1200.0, 1000.0, 900.0, 1100.0, 1000.0]  # the host's state, alike for both modes
    noisy_off, noisy_fixed = [1000.0, 1100.0, 900.0, 1050.0, 950.0, 1000.0], [1100.0, 900.0, 1000.0, 950.0, 1050.0, 1000.0]
    results = [row("off", 1, quiet), row("fixed", 1, [x * 1.3 for x in quiet]),  # fixed faster: the spread counts
               row("off", 4, drift), row("fixed", 4, drift),
               row("off", 16, noisy_off), row("fixed", 16, noisy_fixed), row("adaptive", 16, noisy_off),
               row("off", 32, quiet[:2]), row("fixed", 32, quiet[:2])]  # 2 repeats: too few to read
    report = {"config": {"interleaved": True}, "results": results}
    res = goal_resolution(report)
    assert set(res) == {"c1", "c4", "c16"}
    assert res["c1"]["cell_sd"] < 0.002 and res["c1"]["p_median"] == res["c1"]["p_paired"] == 1.0
    assert res["c4"]["cell_sd"] == pytest.approx(0.0, abs=1e-9) and res["c4"]["drift_sd"] > 0.1
    assert res["c4"]["p_median"] == res["c4"]["p_paired"] == 1.0  # drift alone never fails a mode equal to the best
    logs = [math.log(a / b) for a, b in zip(noisy_off, noisy_fixed)]
    mean = sum(logs) / len(logs)
    expect_sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1) / 2)
    assert res["c16"]["cell_sd"] == pytest.approx(expect_sd) and res["c16"]["repeats"] == 6
    assert 0.2 < res["c16"]["p_median"] < 0.8 and 0.2 < res["c16"]["p_paired"] < 0.8  # ~10% per cell: a coin toss
    assert goal_resolution(report) == res  # seeded: the same report reads the same
    assert goal_resolution(report, floor=0.5)["c16"]["p_median"] == 1.0
    table = format_table(report)
    assert "resolution of adaptive / max(off, fixed) >= 0.97" in table and "c16 passes in" in table
    assert goal_resolution({"config": {"interleaved": False}, "results": results}) == {}  # sequential: no pairs


def test_the_plot_draws_each_modes_line_and_with_repeats_every_run(tmp_path):
    from specops.bench.serve import plot_report

    def row(mode, c, runs):
        return {"mode": mode, "concurrency": c, "output_tokens_per_s": sorted(runs)[(len(runs) - 1) // 2],
                "output_tokens_per_s_runs": runs, "tpot_p99_s": 0.01}

    for name, runs in (("one", [100.0]), ("three", [90.0, 100.0, 120.0])):
        report = {"results": [row(m, c, [x * c for x in runs]) for m in ("off", "adaptive") for c in (1, 4, 16)]}
        path = plot_report(report, tmp_path / name / "serve.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_streamed_requests_canary_probe_and_fallback_flags_come_from_its_usage_chunk():
    """`_one` reads the final chunk's ``specops`` object: a canary's or a fallback probe's request
    counts as observed (it speculates as set, whatever the planner measures), a request decoded
    plainly because its class is fallen back as fallen back."""
    from specops.bench import serve
    from tests.serving.sse_stub import sse_route, with_stub

    finals = iter([{"canary": False, "probe": True, "fallback_reason": None, "drafted": 4, "accepted": 3},
                   {"canary": True, "probe": False, "fallback_reason": None},
                   {"canary": False, "probe": False, "fallback_reason": "policy_fallback"},
                   {"canary": False, "probe": False, "fallback_reason": "deadline"}])

    def chunks(body):
        return [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                {"choices": [], "usage": {"completion_tokens": 2}, "specops": next(finals)}]

    async def client(session, url):
        return [await serve._one(session, url, "m", "p", 0.0, ServeBenchConfig(), {}) for _ in range(4)]

    results = with_stub("/v1/completions", sse_route(chunks), client)
    assert all(r.ok and r.output_tokens == 2 for r in results)
    assert [(r.observed, r.fallen_back) for r in results] == [(True, False), (True, False), (False, True),
                                                              (False, False)]
    assert (results[0].drafted, results[0].accepted) == (4, 3)


# -- fresh prompts and the controller outside its cells ------------------------------------------
BLOCK = 16  # the serving engine's default KV block (tokens): its prefix cache reuses whole blocks


def test_the_block_size_is_the_engines_default():
    import inspect

    from specops.engine.engine import Engine

    assert inspect.signature(Engine.__init__).parameters["block_size"].default == BLOCK


def _prefix_blocks(tokenizer, prompts) -> set[tuple[int, ...]]:
    """Every block-aligned token prefix of ``prompts``: what a prefix cache keys a block by (its
    tokens and every block before it)."""
    out = set()
    for text, _ in prompts:
        ids = tuple(tokenizer.encode(text))
        out.update(ids[:k * BLOCK] for k in range(1, len(ids) // BLOCK + 1))
    return out


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from transformers import AutoTokenizer

    import specops.assets

    return AutoTokenizer.from_pretrained(str(Path(specops.assets.__file__).parent))


def _record_batches(monkeypatch, serve, *, one_server: bool):
    """Run the orchestration with fakes; returns [(server, measured, prompts)] of every batch sent."""
    batches = []

    class Store:
        def effective(self):
            return {"code": 6}

        def current_policy(self):
            from specops.policies.loader import load_policy

            return load_policy(DEFAULT_POLICY)

    async def cell(url, model, prompts, c, cfg, on_done=None):
        batches.append((url, on_done is not None, list(prompts)))  # measured cells report progress
        await asyncio.sleep(0.01)  # a few batches of warm-up / settle traffic in their 0.05 s, not hundreds
        return [serve.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, output_tokens=8)], 0.1

    fake_policy_store(monkeypatch, lambda client, namespace: Store())
    monkeypatch.setattr(serve.procs, "_start_server", recording_starter([], "http://one" if one_server else None))
    monkeypatch.setattr(serve.procs, "_start_controller", lambda cfg, r, w, ns=None, paused=False: FakeProc())
    for name in ("_stop", "_pause", "_resume"):
        monkeypatch.setattr(serve.procs, name, lambda proc, timeout_s=20.0: None)
    monkeypatch.setattr(serve.procs, "_wait_ready", lambda url, timeout_s, proc=None: {"model": "m", "policy": {}})
    monkeypatch.setattr(serve.settings, "_apply_mode", lambda store, mode: {})
    monkeypatch.setattr(serve.settings, "_restore_adaptive", lambda store, kept: {})
    monkeypatch.setattr(serve.settings, "_wait_settings", lambda url, expected, timeout_s=30.0: None)
    monkeypatch.setattr(serve.scrape, "planner_counts", lambda url: None)
    monkeypatch.setattr(serve.load, "run_cell", cell)
    return batches


@pytest.mark.parametrize("one_server", [False, True])
def test_fresh_cells_share_no_prefix_block_with_any_other_traffic_and_warm_ones_replay_theirs(
        monkeypatch, bundled_tokenizer, one_server):
    """Fresh (the default): a measured cell's prompts share no block-aligned prefix with anything
    its server was sent before (the other repeats' cells, the other modes' on one server, warm-up
    and settle batches), so it finds nothing of them in the prefix cache; the warm replay does."""
    from specops.bench import serve

    reports = {}
    for warm in (False, True):
        batches = _record_batches(monkeypatch, serve, one_server=one_server)
        cfg = serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[4], repeats=2, num_prompts=6,
                                     adaptive_warmup_s=0.05, one_server=one_server,
                                     settle_s=0.05 if one_server else None, warm_prefix=warm, progress=True)
        reports[warm] = serve.run_bench_serve(cfg)
        assert sum(measured for _, measured, _ in batches) == 2 * 3  # 2 repeats x 3 modes
        assert len(batches) > 2 * 3 + 3  # and unmeasured traffic: warm-ups (and settles) in between
        shared, seen = [], {}
        for url, measured, prompts in batches:
            mine = _prefix_blocks(bundled_tokenizer, prompts)
            if measured:
                assert mine  # the prompts are longer than a block
                shared.append(len(mine & seen.get(url, set())))
            seen.setdefault(url, set()).update(mine)
        if warm:
            assert all(shared[3:]) and all(shared)  # repeat 1 (and already repeat 0 after its warm-up) replays
        else:
            assert shared == [0] * 6
    assert reports[False]["config"]["prompts"] == "fresh" and reports[True]["config"]["prompts"] == "warm"
    assert all(r["prompts"] == "fresh" for r in reports[False]["results"])
    assert all(r["prompts"] == "warm" for r in reports[True]["results"])
    assert serve.format_table(reports[False]).startswith("prompts: fresh (")
    assert serve.format_table(reports[True]).startswith("prompts: warm (--warm-prefix")


def test_fresh_tags_keep_the_mixs_classes_and_the_report_classifies_what_is_sent():
    from specops.bench import serve
    from specops.policies.loader import load_policy

    policy = load_policy(DEFAULT_POLICY)
    cfg = serve.ServeBenchConfig()
    tags = serve.PromptTags(warm=False, run="abc123")
    assert serve.mix_classes(policy, cfg, {16: 128}, tags) == serve.mix_classes(policy, cfg, {16: 128})
    drawn = serve.build_prompts(cfg, 4)
    first, second = tags.fresh(drawn), tags.fresh(drawn)
    assert [t for _, t in first] == [t for _, t in drawn]  # temperatures untouched
    assert first[0][0] == "#1-abc123\n" + drawn[0][0] and second[0][0] == "#2-abc123\n" + drawn[0][0]
    assert tags.example(drawn)[0][0].startswith("#0-abc123\n") and tags.serial == 2  # no tag used up
    assert serve.PromptTags(warm=True).fresh(drawn) == drawn
    assert serve.PromptTags(warm=False).run != serve.PromptTags(warm=False).run  # a new run, new tags


def test_the_cli_sends_fresh_prompts_unless_told_warm_prefix(monkeypatch):
    from click.testing import CliRunner

    from specops.bench import serve
    from specops.cli import main

    seen = []
    monkeypatch.setattr(serve.orchestrate, "run_bench_serve",
                        lambda cfg: seen.append(cfg.warm_prefix) or {"config": {"prompts": cfg.prompts_label},
                                                                     "results": []})
    for args, warm in (([], False), (["--warm-prefix"], True)):
        result = CliRunner().invoke(main, ["bench", "serve", "--redis", "redis://127.0.0.1:9/0", *args])
        assert result.exit_code == 0, result.output
        assert seen[-1] is warm and result.output.startswith(f"prompts: {'warm' if warm else 'fresh'} (")


def test_with_a_server_per_mode_the_controller_runs_only_in_the_adaptive_cells(monkeypatch):
    """It adapts from its server's warm-up, then is paused: not during the later servers' warm-up
    nor the other modes' cells, where it would keep adapting and spend the host's CPUs."""
    from specops.bench import serve

    running = {"controller": False}
    seen, leases = [], []

    def start_controller(cfg, r, w, ns=None, paused=False):
        leases.append(paused)
        running["controller"] = True
        return FakeProc("controller")

    def pause(proc):
        assert proc.name == "controller"
        running["controller"] = False

    def resume(proc):
        assert proc.name == "controller"
        running["controller"] = True

    async def cell(url, model, prompts, c, cfg, on_done=None):
        if on_done is not None:
            seen.append(("measure", url.split("-", 1)[1], running["controller"]))
        return [serve.RequestResult(ok=True, ttft_s=0.01, e2e_s=0.1, output_tokens=8)], 0.1

    monkeypatch.setattr(serve.procs, "_start_server", recording_starter([]))
    monkeypatch.setattr(serve.procs, "_start_controller", start_controller)
    monkeypatch.setattr(serve.procs, "_pause", pause)
    monkeypatch.setattr(serve.procs, "_resume", resume)
    monkeypatch.setattr(serve.procs, "_stop", lambda proc, timeout_s=20.0: None)
    monkeypatch.setattr(serve.procs, "_wait_ready", lambda url, timeout_s, proc=None: {"model": "m", "policy": {}})
    monkeypatch.setattr(serve.settings, "_apply_mode", lambda store, mode: {})
    monkeypatch.setattr(serve.settings, "_wait_settings", lambda url, expected, timeout_s=30.0: None)
    monkeypatch.setattr(serve.load, "_adaptive_warmup",
                        lambda url, model, cfg, tags: seen.append(("warmup", url.split("-", 1)[1],
                                                                   running["controller"])))
    monkeypatch.setattr(serve.scrape, "planner_counts", lambda url: None)
    monkeypatch.setattr(serve.load, "run_cell", cell)
    cfg = serve.ServeBenchConfig(redis_url="redis://127.0.0.1:9/0", concurrency=[1, 4], repeats=2, num_prompts=1,
                                 twin=True, progress=True)  # (measured cells report progress; warm-ups do not)
    serve.run_bench_serve(cfg)
    assert leases == [True]  # paused for longer than a 15 s lease: it holds a long one
    assert [s for s in seen if s[0] == "warmup"] == [("warmup", "off", False), ("warmup", "fixed", False),
                                                     ("warmup", "adaptive", True), ("warmup", "off-twin", False)]
    measured = [s for s in seen if s[0] == "measure"]
    assert len(measured) == 2 * 2 * 4
    assert all(on == (mode == "adaptive") for _, mode, on in measured), measured
