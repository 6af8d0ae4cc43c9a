"""``specops sidecar``: option parsing, then `run_sidecar` (wiring in `specops.sidecar.server`)."""

from __future__ import annotations

import logging

import click

from specops.sidecar.fields import ENGINES


def _upstreams(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{value!r}: expected NAME=http(s)://HOST:PORT", param_hint="--upstream")
        if name in out:
            raise click.BadParameter(f"pool {name!r} given twice", param_hint="--upstream")
        out[name] = url.rstrip("/")
    return out


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r}: expected HOST:PORT", param_hint="--listen")
    return host.strip("[]"), int(port)


@click.command("sidecar")
@click.option("--engine", type=click.Choice(ENGINES), required=True,
              help="Engine behind the pools (which per-request fields and /metrics names to read).")
@click.option("--upstream", "upstreams", multiple=True, required=True, metavar="NAME=URL",
              help="An engine pool, e.g. spec=http://127.0.0.1:8000 (repeat; names as in the policy's upstreams).")
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="Policy file: classes and pools; stored as the first revision when Redis has none.")
@click.option("--redis", "redis_url", envvar="SPECOPS_REDIS", default=None,
              help="Redis URL for live settings and telemetry (none: the policy file only, no telemetry in Redis).")
@click.option("--namespace", default="specops", show_default=True, help="Key namespace in Redis.")
@click.option("--pod", default=None, help="Pod name in the telemetry (default: hostname-pid).")
@click.option("--listen", default="127.0.0.1:9400", show_default=True,
              help="HOST:PORT to serve on; in a pod use 0.0.0.0:9400 so the Service reaches it.")
@click.option("--reconcile-s", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
              help="Re-read the live settings at least this often (change notifications apply at once).")
@click.option("--connect-timeout-s", type=click.FloatRange(min=0.01), default=2.0, show_default=True)
@click.option("--read-timeout-s", type=click.FloatRange(min=0.01), default=60.0, show_default=True,
              help="Longest silence from an engine (before its answer, or between two stream chunks).")
@click.option("--request-timeout-s", type=click.FloatRange(min=0.1), default=600.0, show_default=True,
              help="Longest a whole request (a stream included) may take.")
@click.option("--scrape-s", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Scrape the engines' /metrics this often.")
@click.option("--records", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Who writes per-request records to Redis: auto = the engine for --engine specops (it records "
                   "itself), the sidecar for vllm/sglang/llamacpp; on = the sidecar (specops pools in namespaces of "
                   "their own).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def sidecar_command(engine, upstreams, policy_file, redis_url, namespace, pod, listen, reconcile_s,
                    connect_timeout_s, read_timeout_s, request_timeout_s, scrape_s, records, log_level) -> None:
    """Class-aware OpenAI proxy in front of vLLM / SGLang / llama.cpp / specops pools (routing, telemetry,
    fail-open).

    Each request is recorded in Redis once: ``--records auto`` leaves it to a ``specops serve``
    engine (which records what it ran) and writes it itself for vLLM / SGLang / llama.cpp.
    """
    from specops.sidecar.server import SidecarError, SidecarOptions, run_sidecar

    host, port = _listen(listen)
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    opts = SidecarOptions(engine=engine, upstreams=_upstreams(upstreams), policy_file=policy_file,
                          redis_url=redis_url, namespace=namespace, pod=pod, host=host, port=port,
                          reconcile_s=reconcile_s, connect_timeout_s=connect_timeout_s,
                          read_timeout_s=read_timeout_s, request_timeout_s=request_timeout_s, scrape_s=scrape_s,
                          records=records, log_level=log_level)
    try:
        run_sidecar(opts)
    except SidecarError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("engine-config")
@click.option("--engine", type=click.Choice(["vllm", "sglang", "llamacpp"]), required=True)
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--measured", type=click.Path(exists=True, dir_okay=False), default=None,
              help="`specops bench serve --json` report: vLLM's per-batch-size K table from it; llama.cpp: "
                   "the K at --parallel requests.")
@click.option("--method", type=click.Choice(["draft", "ngram", "medusa"]), default=None,
              help="The pool's method when the policy's classes use several.")
@click.option("--model", default=None, help="Draft model / Medusa heads path or id for the engine "
              "(llama.cpp: the draft model's GGUF file).")
@click.option("--pool", type=click.Choice(["spec", "plain"]), default="spec", show_default=True,
              help="llama.cpp: which pool's arguments (the plain pool: --spec-type none).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="llama.cpp: --threads of the pool.")
@click.option("--parallel", type=click.IntRange(min=1), default=None,
              help="llama.cpp: --parallel slots (requests decoded at once).")
@click.option("--format", "fmt", type=click.Choice(["shell", "json"]), default="shell", show_default=True,
              help="shell: one quoted line; json: the argv list.")
def engine_config_command(engine, policy_file, measured, method, model, pool, threads, parallel, fmt) -> None:
    """Print the launch arguments of a vLLM / SGLang / llama.cpp pool, rendered from the policy."""
    import json
    import shlex

    from specops.policies import PolicyError, load_policy
    from specops.sidecar.engine_config import EngineConfigError, render

    try:
        policy = load_policy(policy_file)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None
    report = None
    if measured:
        try:
            with open(measured, encoding="utf-8") as fh:
                report = json.load(fh)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(f"{measured}: {exc}", param_hint="--measured") from None
    try:
        args = render(engine, policy, method=method, model=model, measured=report, pool=pool, threads=threads,
                      parallel=parallel)
    except EngineConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(args) if fmt == "json" else " ".join(shlex.quote(a) for a in args))
