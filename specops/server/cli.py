"""``specops serve``: option parsing, then `run_server` (the wiring lives in `specops.server.server`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

import click

OMP_SPIN_COUNT = "30000"
"""``GOMP_SPINCOUNT`` that `specops serve` sets for torch's OpenMP runtime (libgomp) unless the
user chose one, or a wait policy (``OMP_WAIT_POLICY``). libgomp's default lets a worker spin for
300,000 rounds (~3 ms on the project's 2-core host) after every parallel region before it sleeps.
Whatever runs in torch's OpenMP team (models off the C layer stack, and prefills handed to
oneDNN) leaves its workers spinning while the next step runs on the C layer
stack's own thread pool, whose worker then finds its core taken, so that step ran on one core:
in-process at 16 staggered requests, the first decode step after a oneDNN prefill took 6.9-7.6 ms
against 3.7-4.9 ms for the others. 30,000 rounds still catch the next region inside one torch
forward (its total time unchanged within noise) and stop within ~0.3 ms after it. It must be set
before torch loads libgomp, which reads it once."""

GIL_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval in `specops serve` (Python's default: 5 ms). The engine
steps in its own thread and calls the C kernels through ctypes, which drops the GIL for each call;
taking it back waits until the thread holding it (the HTTP event loop, serializing and streaming
tokens) blocks or is made to yield, which Python asks of it only after the switch interval. A
speculative step makes several such calls (the drafting chain, the verification, the sampling),
so it waited more than a plain one. `specops bench serve --concurrency 1,4 --repeats 3`, two
pairs of runs with and without (2-core host): fixed / off at c1 1.44 / 1.41x against 1.26 /
1.28x, adaptive / off at c1 1.38 / 1.37x against 1.20 / 1.24x; at c4 fixed / off 1.10 / 0.92x
against 0.96 / 0.89x, adaptive / off 0.97 / 1.10x against 0.96 / 0.92x."""


def quiet_omp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to `OMP_SPIN_COUNT` unless the user set it or ``OMP_WAIT_POLICY``, or
    torch is already loaded (too late to matter); True when it was set."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ or "torch" in sys.modules:
        return False
    environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    return True


@click.command("serve")
@click.option("--model", default="bundled", show_default=True,
              help="'bundled', a model folder, or a registered model's name (`specops models list`; "
                   "pulled on first use).")
@click.option("--draft", type=click.Path(exists=True, file_okay=False), default=None,
              help="Draft model folder (default: the bundled draft with the bundled target).")
@click.option("--medusa", type=click.Path(exists=True), default=None,
              help="Medusa heads [default: the bundled heads with the bundled target; for a registered model, the "
                   "heads `specops train heads --model NAME --chat` cached, when there are some].")
@click.option("--eagle", type=click.Path(exists=True, file_okay=False), default=None,
              help="EAGLE drafter folder (`specops train eagle`) for method eagle [default: for a registered "
                   "model, the drafter `specops train eagle --model NAME` cached, when there is one].")
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Bootstrap policy (default: examples/policies/default.yaml); stored when Redis has none "
                   "(when it holds another, a warning: roll it out with `specops policy rollout`).")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="Redis URL (redis://, rediss://, unix://); none: an embedded Redis in --state-dir.")
@click.option("--state-dir", default=".specops", show_default=True, help="Data directory of the embedded Redis.")
@click.option("--namespace", default="specops", show_default=True, help="Key namespace in Redis.")
@click.option("--pod", default=None, help="Pod name in the telemetry (default: hostname-pid).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="Most sequences in one engine step.")
@click.option("--max-queue", type=click.IntRange(0, 100_000), default=256, show_default=True,
              help="Requests waiting beyond --max-batch before 429.")
@click.option("--kv-cache-mb", type=click.FloatRange(min=1.0), default=None,
              help="Memory budget of the paged KV cache (target and draft) [default: --max-batch sequences "
                   "at the model's full context, twice over (the second half keeps the prefix cache), "
                   "at most half the memory available at start; the choice is logged].")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="Require 'Authorization: Bearer <key>' with the key read from this environment variable.")
@click.option("--served-model-name", default=None, help="Model id in the API (default: 'bundled' or the folder name).")
@click.option("--reconcile-s", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="Re-read the policy settings at least this often (change notifications apply at once).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of the engine's forwards (default: torch's); on torch's own kernels "
                   "(not the C layer stack) the engine leaves one of them to the HTTP event loop "
                   "from 4 running sequences on.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights of the target (and draft): bfloat16 reads half the bytes per token (a registered "
                   "model loads its bf16/ copy; on a CPU the C kernels stream the bf16 weights and accumulate "
                   "in fp32).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve_command(model, draft, medusa, eagle, policy_file, redis_url, state_dir, namespace, pod, host, port, max_batch,
                  max_queue, kv_cache_mb, api_key_env, served_model_name, reconcile_s, threads, dtype,
                  log_level) -> None:
    """Serve the OpenAI-compatible API with continuous batching and the live speculation policy."""
    quiet_omp_spin()  # before the import below loads torch
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from specops.server.server import ServeConfig, ServeError, run_server

    if eagle is not None:
        from specops.models.eagle_io import is_eagle3_dir
        from specops.engine.eagle_proposer import eagle3_refusal

        if is_eagle3_dir(eagle):
            raise click.BadParameter(eagle3_refusal(f"{eagle} holds an EAGLE-3 drafter, which"),
                                     param_hint="--eagle")

    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env, "").strip()
        if not api_key:
            raise click.BadParameter(f"environment variable {api_key_env} is unset or empty",
                                     param_hint="--api-key-env")
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServeConfig(model=model, draft=draft, medusa=medusa, eagle=eagle, policy_file=policy_file, redis_url=redis_url,
                      state_dir=state_dir, namespace=namespace, pod=pod, host=host, port=port, max_batch=max_batch,
                      max_queue=max_queue, kv_cache_mb=kv_cache_mb, api_key=api_key,
                      served_model_name=served_model_name, reconcile_s=reconcile_s, threads=threads,
                      dtype=dtype, log_level=log_level)
    try:
        run_server(cfg)
    except ServeError as exc:
        raise click.ClickException(str(exc)) from None
