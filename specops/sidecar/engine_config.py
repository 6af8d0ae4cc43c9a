"""Launch arguments for a vLLM / SGLang / llama.cpp speculative pool, rendered from the policy.

Neither engine can change its speculative settings at runtime or per request, so
the policy's choices become start-up flags, and a change is a rolling update of the
pods (the chart's checksum annotation on the rendered config).

vLLM (``--speculative-config`` JSON; ``SpeculativeConfig`` in vllm/config/speculative.py)
    ``method`` (``draft_model`` | ``ngram`` | ``medusa``), ``model`` (draft / heads),
    ``num_speculative_tokens`` = the largest γ any class of that method may use (the
    engine's buffer size), and ``num_speculative_tokens_per_batch_size``: a list of
    inclusive ``[range_start, range_end, K]`` entries (vLLM declares it
    ``list[tuple[int, int, int]]``), starting at batch size 1, sorted, not overlapping.
    Without measurements there is no table (vLLM: dynamic speculation off) — guessing
    one is worse than none. With ``--measured`` (the JSON report of ``specops bench
    serve``, modes ``off`` and ``fixed``/``adaptive``) each measured concurrency gets a
    relative gain of speculation over plain decoding in goodput (requests/s within the
    SLO when the bench had one, else output tokens/s). The table is monotone: K up to a
    cut-off batch size, 0 from there on — speculation never switches back on at a
    larger batch. The cut-off is the one whose speculating prefix has the largest summed
    gain (ties: the smaller prefix), so one noisy point neither switches speculation off
    early when larger batches still gain clearly, nor keeps it on past clear losses.
SGLang (``--speculative-*`` flags)
    ``--speculative-algorithm`` (``STANDALONE`` for a draft model, ``NGRAM``; SGLang has
    no Medusa), ``--speculative-draft-model-path``, ``--speculative-num-steps`` = γ,
    ``--speculative-num-draft-tokens`` = γ + 1, ``--speculative-eagle-topk 1``.
llama.cpp (``llama-server``; option names of the build ``make peers`` makes, the
``--spec-*`` family in common/arg.cpp, checked against its ``--help`` in the tests)
    every pool: ``--metrics`` (the counters the sidecar republishes), ``--threads N`` and
    ``--parallel N`` (slots: the most requests it decodes at once) when given. The
    speculative pool adds ``--spec-type``: ``draft-simple`` with ``--spec-draft-model``
    (a GGUF file) and ``--spec-draft-n-max`` = γ, or ``ngram-simple`` (prompt lookup:
    the last ``--spec-ngram-simple-size-n`` = `NGRAM_LOOKUP` tokens looked up in the
    context, the ``--spec-ngram-simple-size-m`` = γ tokens that followed proposed);
    llama.cpp has no Medusa. The plain pool (``pool="plain"``) gets ``--spec-type none``.
    γ is the largest initial γ of the pool's classes (fixed for the process's life).
    With ``--measured`` (needs ``parallel``) γ is the K that `batch_table` gives at a
    batch of ``parallel`` requests, the pool's full load; when that is 0 the measurements
    say speculation loses there, which is reported as an error rather than rendered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specops.policies.schema import Policy

VLLM_METHODS = {"draft": "draft_model", "ngram": "ngram", "medusa": "medusa"}
SGLANG_METHODS = {"draft": "STANDALONE", "ngram": "NGRAM"}
LLAMACPP_METHODS = {"draft": "draft-simple", "ngram": "ngram-simple"}
LLAMACPP_OPTIONS = ("--metrics", "--threads", "--parallel", "--spec-type", "--spec-draft-model",
                    "--spec-draft-n-max", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m")
NGRAM_LOOKUP = 3  # tokens matched by the n-gram lookup (specops' own n-gram drafter's longest match)
ENGINES = ("vllm", "sglang", "llamacpp")
MAX_BATCH = 4096


class EngineConfigError(ValueError):
    """The policy / measurements cannot be rendered for this engine (one readable line)."""


@dataclass(frozen=True)
class PoolPlan:
    method: str            # policy method: draft | ngram | medusa
    gamma_max: int
    gamma_initial: int
    classes: list[str]


def plan(policy: Policy, method: str | None = None) -> PoolPlan:
    """The speculative pool's method and γ bounds from the policy's speculating classes."""
    speculating = [c for c in policy.classes if c.method != "off"]
    if not speculating:
        raise EngineConfigError("no class speculates (every method is off): the pool needs no speculative config")
    methods = sorted({c.method for c in speculating})
    if method is None:
        if len(methods) > 1:
            by = {m: [c.name for c in speculating if c.method == m] for m in methods}
            raise EngineConfigError("a pool runs one method, the policy uses "
                                    + "; ".join(f"{m} ({', '.join(n)})" for m, n in by.items())
                                    + ": choose one with --method")
        method = methods[0]
    chosen = [c for c in speculating if c.method == method]
    if not chosen:
        raise EngineConfigError(f"no class uses method {method!r} (methods: {', '.join(methods)})")
    if method == "medusa":
        return PoolPlan(method, max(c.medusa_heads.max for c in chosen), max(c.medusa_heads.initial for c in chosen),
                        [c.name for c in chosen])
    return PoolPlan(method, max(c.gamma.max for c in chosen), max(c.gamma.initial for c in chosen),
                    [c.name for c in chosen])


def _gain(spec: float, plain: float) -> float:
    """Speculation's relative gain over plain decoding at one concurrency, in [-1, 1]."""
    scale = max(abs(spec), abs(plain))
    return 0.0 if scale == 0 else (spec - plain) / scale


def batch_table(measured: dict[str, Any], k: int) -> list[list[int]]:
    """vLLM's ``[[range_start, range_end, K], ...]`` from a ``specops bench serve`` report (see module docstring)."""
    rows = measured.get("results") if isinstance(measured, dict) else None
    if not isinstance(rows, list):
        raise EngineConfigError("measured file has no 'results' list (expected `specops bench serve --json`)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise EngineConfigError(f"K must be a positive integer, got {k!r}")
    cfg = measured.get("config") if isinstance(measured.get("config"), dict) else {}
    use_goodput = bool(cfg.get("slo_ttft_s") or cfg.get("slo_tpot_s"))
    metric = "goodput_rps" if use_goodput else "output_tokens_per_s"
    plain: dict[int, float] = {}
    spec: dict[int, float] = {}
    for row in rows:
        if not isinstance(row, dict):
            continue
        concurrency = row.get("concurrency")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_BATCH:
            continue
        value = row.get(metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or row.get("errors"):
            continue
        if row.get("mode") == "off":
            plain[concurrency] = float(value)
        elif row.get("mode") in ("fixed", "adaptive"):
            spec[concurrency] = max(spec.get(concurrency, float(value)), float(value))
    points = sorted(set(plain) & set(spec))
    if not points:
        raise EngineConfigError(f"measured file has no concurrency with both an 'off' and a speculative row "
                                f"(error-free, with {metric})")
    # speculate on the first `cut` measured points (each covering the batch sizes above the
    # previous point's, the last one up to MAX_BATCH), plain decoding on the rest
    best_cut, best_sum, running = 0, 0.0, 0.0
    for i, c in enumerate(points):
        running += _gain(spec[c], plain[c])
        if running > best_sum + 1e-12:
            best_cut, best_sum = i + 1, running
    if best_cut == 0:
        return [[1, MAX_BATCH, 0]]
    if best_cut == len(points):
        return [[1, MAX_BATCH, k]]
    last = points[best_cut - 1]
    return [[1, last, k], [last + 1, MAX_BATCH, 0]]


def _k_at(table: list[list[int]], batch: int) -> int:
    for start, end, k in table:
        if start <= batch <= end:
            return k
    return 0


def render_llamacpp(policy: Policy, *, method: str | None = None, model: str | None = None,
                    measured: dict[str, Any] | None = None, pool: str = "spec", threads: int | None = None,
                    parallel: int | None = None) -> list[str]:
    """llama-server's arguments for one pool (see the module docstring)."""
    if pool not in ("spec", "plain"):
        raise EngineConfigError(f"pool must be spec or plain, got {pool!r}")
    for name, value in (("threads", threads), ("parallel", parallel)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EngineConfigError(f"--{name} must be a positive integer, got {value!r}")
    args = ["--metrics"]
    if threads is not None:
        args += ["--threads", str(threads)]
    if parallel is not None:
        args += ["--parallel", str(parallel)]
    if pool == "plain":
        if measured is not None or model:
            raise EngineConfigError("the plain pool takes no --measured or --model (it does not speculate)")
        return args + ["--spec-type", "none"]
    p = plan(policy, method)
    if p.method not in LLAMACPP_METHODS:
        raise EngineConfigError(f"llama.cpp has no {p.method} speculation (use draft or ngram for this pool)")
    gamma = p.gamma_initial
    if measured is not None:
        if parallel is None:
            raise EngineConfigError("--measured needs --parallel (the batch size whose K the pool runs)")
        gamma = _k_at(batch_table(measured, p.gamma_initial), parallel)
        if gamma == 0:
            raise EngineConfigError(f"the measurements show speculation losing at {parallel} parallel requests: "
                                    "run this pool plain (--pool plain) or with fewer --parallel slots")
    args += ["--spec-type", LLAMACPP_METHODS[p.method]]
    if p.method == "draft":
        if not model:
            raise EngineConfigError("method draft needs --model (the draft model's GGUF file)")
        return args + ["--spec-draft-model", model, "--spec-draft-n-max", str(gamma)]
    if model:
        raise EngineConfigError("method ngram takes no --model (it drafts from the context)")
    return args + ["--spec-ngram-simple-size-n", str(NGRAM_LOOKUP), "--spec-ngram-simple-size-m", str(gamma)]


def render(engine: str, policy: Policy, *, method: str | None = None, model: str | None = None,
           measured: dict[str, Any] | None = None, pool: str = "spec", threads: int | None = None,
           parallel: int | None = None) -> list[str]:
    """The pool's launch arguments, one argv item per element."""
    if engine == "llamacpp":
        return render_llamacpp(policy, method=method, model=model, measured=measured, pool=pool,
                               threads=threads, parallel=parallel)
    if pool != "spec" or threads is not None or parallel is not None:
        raise EngineConfigError(f"--pool, --threads and --parallel are llama.cpp options; {engine} pools take "
                                "their speculative flags only")
    p = plan(policy, method)
    if engine == "vllm":
        if p.method not in VLLM_METHODS:
            raise EngineConfigError(f"no vLLM rendering of method {p.method} (use draft, ngram or medusa for this pool)")
        spec: dict[str, Any] = {"method": VLLM_METHODS[p.method], "num_speculative_tokens": p.gamma_max}
        if p.method in ("draft", "medusa"):
            if not model:
                raise EngineConfigError(f"method {p.method} needs --model (the draft model / Medusa heads)")
            spec["model"] = model
        elif p.method == "ngram":
            spec["prompt_lookup_max"] = 4
            spec["prompt_lookup_min"] = 1
        if measured is not None:
            spec["num_speculative_tokens_per_batch_size"] = batch_table(measured, p.gamma_initial)
        return ["--speculative-config", json.dumps(spec, sort_keys=True)]
    if engine == "sglang":
        if p.method not in SGLANG_METHODS:
            raise EngineConfigError(f"SGLang has no {p.method} speculation (use draft or ngram for this pool)")
        if measured is not None:
            raise EngineConfigError("SGLang takes no per-batch-size table: drop --measured for sglang")
        args = ["--speculative-algorithm", SGLANG_METHODS[p.method], "--speculative-num-steps", str(p.gamma_initial),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(p.gamma_initial + 1)]
        if p.method == "draft":
            if not model:
                raise EngineConfigError("method draft needs --model (the draft model)")
            args += ["--speculative-draft-model-path", model]
        return args
    raise EngineConfigError(f"unknown engine {engine!r}")
