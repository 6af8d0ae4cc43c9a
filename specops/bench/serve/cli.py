"""``specops bench serve``'s command line."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from specops.bench.serve import orchestrate
from specops.bench.serve.config import (BATCHED_CELL_REQUESTS, CHAT_SUITE, DEFAULT_MIX, MIN_CELL_REQUESTS, MIX_SUITE, MODES,
                                        REQUESTS_PER_SLOT, SUITES, TWIN, BenchServeError, ServeBenchConfig, parse_mix,
                                        parse_slo)
from specops.bench.serve.plot import plot_report
from specops.bench.serve.table import emit_report, format_table


@click.command("serve")
@click.option("--base-url", default=None, help="A running server (default: start one on the bundled models).")
@click.option("--model", default=None, metavar="NAME|PATH",
              help="The started servers' target: a registered model's name (`specops models list`; pulled now "
                   "on first use) or a model folder, served alone: the server's policy (its --server-arg "
                   "--policy, else examples/policies/default.yaml) is rewritten with the same classes on ngram, "
                   "and on eagle where n-gram does little when an EAGLE drafter is cached (`specops train eagle`; "
                   "or --server-arg --eagle DIR); with --suite chat the policy is examples/policies/chat-model.yaml "
                   "unless given. Not with --base-url.")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="The server's Redis (required with --base-url; default: an embedded one for the started server).")
@click.option("--namespace", default="specops", show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated: off,fixed,adaptive.")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated max concurrencies.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help=f"Requests per cell (default {REQUESTS_PER_SLOT} x conc, >= {MIN_CELL_REQUESTS}; from "
                   f"concurrency 2 on >= min(32 x conc, {BATCHED_CELL_REQUESTS})).")
@click.option("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: all at once).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--suite", type=click.Choice(SUITES), default=MIX_SUITE, show_default=True,
              help="mix: the bundled code / prose suites as /v1/completions text, weighted by --mix (or a --prompts "
                   "file); chat: the chat-model suites' conversations (multi-turn chat, code, factual Q&A, creative "
                   "at temperature 0.8) as /v1/chat/completions messages, each labelled task=<its class> (the "
                   "server renders them with its model's chat template).")
@click.option("--mix", default=None, help=f"KIND:WEIGHT,... of code, prose, hot  [default: {DEFAULT_MIX}]")
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
def bench_serve_command(base_url, model, redis_url, namespace, modes, concurrency, num_prompts, request_rate, max_tokens,
                        suite, mix, prompts_file, slo, api_key_env, json_path, plot_path, seed, adaptive_warmup_s, server_args,
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
        if suite == CHAT_SUITE and (mix is not None or prompts_file):
            raise ValueError("--suite chat sends the chat-model suites' conversations: it takes no --mix or --prompts")
        mix_weights = parse_mix(mix if mix is not None else DEFAULT_MIX)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    api_key = os.environ.get(api_key_env, "").strip() if api_key_env else None
    cfg = ServeBenchConfig(base_url=base_url, redis_url=redis_url, namespace=namespace, modes=mode_list,
                           concurrency=conc, num_prompts=num_prompts, request_rate=request_rate, max_tokens=max_tokens,
                           mix=mix_weights, prompts_file=prompts_file, suite=suite, slo_ttft_s=ttft, slo_tpot_s=tpot,
                           api_key=api_key, seed=seed, server_args=list(server_args), progress=not quiet,
                           adaptive_warmup_s=adaptive_warmup_s, repeats=repeats, twin=twin, one_server=one_server,
                           settle_s=settle_s, warm_prefix=warm_prefix, model=model)
    try:
        report = orchestrate.run_bench_serve(cfg)
    except BenchServeError as exc:
        raise click.ClickException(str(exc)) from None
    emit_report(report, format_table(report), json_path, plot_path, plot_report)
