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

``--model NAME|PATH``: the started servers serve that target alone (no draft model or Medusa
heads), on the server's policy rewritten to n-gram, and EAGLE where a cached drafter helps
(`model`). ``--suite chat`` sends the chat-model suites' conversations to
``/v1/chat/completions`` instead of the mix's completion text, each labelled with its class
(`prompts.ChatPrompt`); a lone target then runs examples/policies/chat-model.yaml unless given a policy.

Its parts, one module each: `config` (the modes, options and the config), `prompts` (the mix and
its fresh tags), `model` (``--model``: the lone target's policy), `load` (the load generator), `procs` (the started server and controller
processes), `settings` (each mode's settings through Redis), `scrape` (a server's ``/metrics`` per
cell), `stats` (a cell's figures and the goal ratios), `orchestrate` (`run_bench_serve`),
`table`, `plot` and `cli`. The names below are the bench's interface to the other bench
commands (``bench turns``, the sidecar overhead and speedup benches) and to the tests.
"""

from specops.bench.serve.cli import bench_serve_command
from specops.bench.serve.config import (BATCHED_CELL_REQUESTS, MIN_CELL_REQUESTS, MIX_KINDS, MODES, REQUESTS_PER_SLOT,
                                        TWIN, BenchServeError, RequestResult, ServeBenchConfig, cell_requests,
                                        parse_mix, parse_slo)
from specops.bench.serve.load import _adaptive_warmup, _one, _settle, _traffic, run_cell
from specops.bench.serve.settings import _apply_mode, _expected, _restore_adaptive, _settings_text, _wait_settings
from specops.bench.serve.orchestrate import cell_order, run_bench_serve
from specops.bench.serve.plot import plot_report
from specops.bench.serve.procs import (_free_port, _log_tail, _pause, _resume, _start_controller, _start_server, _stop,
                                       _wait_ready)
from specops.bench.serve.prompts import PromptTags, build_prompts, mix_classes
from specops.bench.serve.scrape import (CPU_SERIES, PLANNER_SERIES, PREFIX_SERIES, cpu_delta, planner_counts,
                                        planner_delta)
from specops.bench.serve.stats import (GOAL_FLOOR, RESOLUTION_DRAWS, _percentile, goal_ratios, goal_resolution,
                                       median_row, paired_ranges, paired_ratios, summarize)
from specops.bench.serve.table import emit_report, format_table

__all__ = [
    "BATCHED_CELL_REQUESTS", "CPU_SERIES", "GOAL_FLOOR", "MIN_CELL_REQUESTS", "MIX_KINDS", "MODES", "PLANNER_SERIES",
    "PREFIX_SERIES", "REQUESTS_PER_SLOT", "RESOLUTION_DRAWS", "TWIN", "BenchServeError", "PromptTags", "RequestResult",
    "ServeBenchConfig", "_adaptive_warmup", "_apply_mode", "_expected", "_free_port", "_log_tail", "_one", "_pause",
    "_percentile", "_restore_adaptive", "_resume", "_settings_text", "_settle", "_start_controller", "_start_server",
    "_stop", "_traffic", "_wait_ready", "_wait_settings", "bench_serve_command", "build_prompts", "cell_order",
    "cell_requests", "cpu_delta", "emit_report", "format_table", "goal_ratios", "goal_resolution", "median_row",
    "mix_classes", "paired_ranges", "paired_ratios", "parse_mix", "parse_slo", "planner_counts", "planner_delta",
    "plot_report", "run_bench_serve", "run_cell", "summarize",
]
