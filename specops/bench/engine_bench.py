"""Engine-only throughput: output tokens/s per method and concurrency, and a step profile.

No HTTP: a `specops.engine.engine.Engine` over the bundled models (``--model NAME|PATH``: that
target alone, with the EAGLE drafter cached for it, if any), ``concurrency``
requests kept in flight (a finished one is replaced at once), greedy, code prompts.
Methods are run interleaved, repeated ``--repeats`` times; the median is reported
with the ratio to ``ar`` at the same concurrency, and where the target forwards' time went
over all repeats: prompt prefill (what the prefix cache did not skip) per request, against
decode per output token. Prefill costs a request the same at any concurrency and decode
is what batching shares, so their split bounds how far tokens/s can scale with it.

    python -m specops.bench.engine_bench --concurrency 1,16 --repeats 3
    python -m specops.bench.engine_bench --profile --concurrency 1,16   # where a step's time goes
    python -m specops.bench.engine_bench --mix --methods ar,policy --concurrency 4 --repeats 4 --threads 2

``--mix``: `specops bench serve`'s prompt mix instead (code / prose / hot, the hot prompts at
temperature 1.0, each request seeded), and the method ``policy``: each request runs its class's
initial settings under the default policy (what `bench serve`'s ``fixed`` mode serves), resolved
by the server's own `PolicyRuntime`. Each method gets its own engine (a method's estimates never
inform another's), so ``policy`` against ``ar`` is the serving comparison without HTTP. With
``--model`` the policy is retargeted to the methods that target has, as `specops bench serve
--model` serves it (`specops.policies.retarget`):

    python -m specops.bench.engine_bench --model smollm2-135m-instruct --mix --methods ar,policy \
        --concurrency 16 --requests 96 --repeats 3 --threads 2 --kv-cache-mb auto

``--suite chat``: the chat-model ``mixed`` suite in the model's chat template instead (every
conversation turn, code, factual Q&A, creative at its sampling temperature; each request seeded),
each method on its own engine; the method ``auto`` chooses per request and per step as the server's
``auto`` classes do:

    python -m specops.bench.engine_bench --model smollm2-135m-instruct --suite chat --methods ar,ngram,eagle,auto \
        --concurrency 1 --requests 24 --repeats 3 --threads 2 --kv-cache-mb auto

Each line gives the median tokens/s and its ratio to ``ar``; with repeats, the median of the
per-repeat paired ratios and their range follow.

``--library``: each method also decodes the same prompts through `Decoder.generate` (the library's
step, `specops.spec.step`, one request at a time), interleaved with the engine's runs; a line per
method gives the engine's tokens/s against the library's (code suite only):

    python -m specops.bench.engine_bench --concurrency 1 --methods ar,draft,ngram,medusa --library \
        --requests 16 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings

RECORDS: list = []  # finished requests' DecodeStats (the profile mode reports drafting from them)
METHOD_SETTINGS = {
    "ar": SpecSettings(method="ar"),
    "draft": SpecSettings(method="draft", gamma=6),
    "ngram": SpecSettings(method="ngram", gamma=6),
    "medusa": SpecSettings(method="medusa", tree_size=16),
    "eagle": SpecSettings(method="eagle", gamma=4),
    "auto": SpecSettings(method="auto", gamma=4),
}


def prompts(dec, n: int) -> list[list[int]]:
    from specops.bench.suites import builtin_suite

    texts = [p.text for p in builtin_suite("code")]
    return [dec.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def chat_requests(dec, n: int) -> list[tuple[list[int], float, SpecSettings]]:
    """``n`` (prompt ids, temperature, settings) from the chat-model ``mixed`` suite (every turn of
    its conversations, code, factual Q&A, creative at its temperature) in the model's chat template,
    repeated in order as needed; the settings are ``ar``'s (each method runs its own)."""
    from specops.bench.chat_suite import chat_model_suite, has_chat_template

    if not has_chat_template(dec.tokenizer):
        raise ValueError("--suite chat needs a model whose tokenizer has a chat template")
    suite = chat_model_suite("mixed", dec.tokenizer)
    return [(dec.tokenizer.encode(p.text), p.temperature, METHOD_SETTINGS["ar"])
            for p in (suite[i % len(suite)] for i in range(n))]


def mix_requests(dec, n: int, policy_file: str | None = None) -> list[tuple[list[int], float, SpecSettings]]:
    """``n`` (prompt ids, temperature, the ``policy`` method's settings) from `bench serve`'s mix."""
    from specops.bench.serve import ServeBenchConfig, build_prompts
    from specops.engine.policy_runtime import PolicyRuntime

    runtime = PolicyRuntime(dec, policy_for(dec, policy_file))
    out = []
    for text, temperature in build_prompts(ServeBenchConfig(), n):
        ids = dec.tokenizer.encode(text)
        res = runtime.resolve(text, len(ids), temperature=temperature, routing_key="bench")
        out.append((ids, temperature, res.spec))  # the settings the server's engine would take
    return out


def policy_for(dec, policy_file: str | None = None):
    """The policy the ``policy`` method runs: ``policy_file`` (default: the server's), its classes
    retargeted to the speculative methods ``dec`` has where it lacks one they name (a target
    served alone, `specops.policies.retarget`)."""
    from specops.policies.loader import parse_policy
    from specops.policies.retarget import retarget_policy

    path = policy_file or default_policy_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    have = [m for m, part in (("draft", dec.draft), ("medusa", dec.medusa), ("eagle", getattr(dec, "eagle", None)))
            if part is not None]
    text, _ = retarget_policy(text, have, source=path)
    return parse_policy(text, path)


def paired(rates: list[float], base: list[float]) -> str:
    """The median of the per-repeat ratios ``rates[i] / base[i]`` and their range."""
    ratios = [a / b for a, b in zip(rates, base)]
    return f"paired {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def default_policy_path() -> str:
    from specops.server.server import DEFAULT_POLICY

    return str(DEFAULT_POLICY)


def run(eng: Engine, method: str, prompt_ids: list[list[int]], concurrency: int,
        max_tokens: int, mix: list[tuple[list[int], float, SpecSettings]] | None = None) -> tuple[float, int, float]:
    """Wall seconds, output tokens and process CPU seconds for all prompts (or ``mix`` requests)
    with ``concurrency`` in flight."""
    pending = list(enumerate(prompt_ids if mix is None else [ids for ids, _, _ in mix]))
    live = 0
    tokens = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or eng.has_unfinished():
        while pending and live < concurrency:
            i, p = pending.pop(0)
            if mix is None:
                params, spec = SamplingParams(max_tokens=max_tokens, ignore_eos=True), METHOD_SETTINGS[method]
            else:
                _, temperature, policy_spec = mix[i]
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
                spec = policy_spec if method == "policy" else METHOD_SETTINGS[method]
            eng.add(f"{method}-{i}", p, params, spec)
            live += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            live -= out.finished
            if out.finished and out.record is not None:
                RECORDS.append(out.record)
    return time.perf_counter() - t0, tokens, time.process_time() - c0


def run_library(dec, method: str, prompt_ids: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Wall seconds and output tokens of ``Decoder.generate`` over the prompts, one after another,
    greedy with no EOS stop (as the engine's runs), at the method's settings (`METHOD_SETTINGS`:
    ``gamma`` where the method takes one; Medusa's own default tree)."""
    spec = METHOD_SETTINGS[method]
    options = {"gamma": spec.gamma} if method in ("draft", "ngram", "eagle", "auto") else {}
    tokens = 0
    t0 = time.perf_counter()
    for ids in prompt_ids:
        tokens += len(dec.generate(ids, method=method, max_new_tokens=max_tokens, **options).tokens)
    return time.perf_counter() - t0, tokens


def forward_split(records: list) -> str:
    """Where the target forwards' wall time went, over finished requests' `DecodeStats`: each
    step's forward time is shared among its sequences by the tokens each fed, so a prompt that
    joins a batch is charged its own rows. Prompt tokens a prefix-cache hit skipped cost nothing
    and are not counted. Output tokens after the first come from decode (or verify) rows."""
    if not records:
        return "forward: no finished requests"
    fwd = sum(r.verify_s for r in records)
    prefill = sum(r.prefill_s for r in records)
    later = sum(max(r.new_tokens - 1, 0) for r in records)
    n = len(records)
    return (f"forward {1e3 * fwd / n:.1f} ms/request: prefill {1e3 * prefill / n:.1f} ms "
            f"({100 * prefill / fwd if fwd > 0 else 0.0:.0f}%), decode {1e3 * (fwd - prefill) / max(later, 1):.2f} ms "
            f"per later output token")


def meters(eng: Engine, c: int) -> str:
    """What the planner believes (ms): verify and draft-round costs, overheads, fixed host time."""
    ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
    parts = [f"verify(B={c},T={c})={ms(eng.cost.predict(c, c))}", f"verify(B={c},T={5 * c})={ms(eng.cost.predict(c, 5 * c))}"]
    if eng.draft is not None:
        parts.append(f"draft_round(B={c})={ms(eng.draft_cost.predict(c, c))}")
    parts += [f"overhead[{m}]={ms(v.value())}" for m, v in eng.accounts.overhead.items()]
    parts.append(f"fixed(B={c})={ms(eng.accounts.fixed_s(c))}")
    return "planner ms: " + " ".join(parts)


def planner_line(eng: Engine) -> str:
    """What the planner did over every run of an engine (warm-up included): the share of
    decode steps where some sequence speculated, vetoes, probes and plain probes."""
    plain, spec = eng.accounts.decode_steps[False], eng.accounts.decode_steps[True]
    return (f"spec steps {100 * spec / max(plain + spec, 1):.1f}% of {plain + spec}, vetoes {eng.schedule.vetoes}, "
            f"probes {eng.schedule.probes}, plain probes {eng.schedule.plain_probes}")


def shared_auto_budget(auto, engines: int) -> float:
    """Each of ``engines`` engines' KV budget in MiB under ``--kv-cache-mb auto``: a server's default
    (``auto``, a `KVBudget`), capped so that all of them together stay within the share of memory
    one server's default may take (the pools are touched as they fill, so each engine alone would
    see the whole machine free and together they could exhaust it)."""
    from specops.engine.kv_budget import KV_MEMORY_FRACTION

    if auto.available_mb is None:
        return auto.mb
    return min(auto.mb, KV_MEMORY_FRACTION * auto.available_mb / engines)


def _budget(text: str) -> str:
    if text != "auto":
        try:
            if float(text) <= 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number of MB or 'auto', got {text!r}") from None
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bundled",
                    help="the target: 'bundled' (with its draft model and Medusa heads), a registered name or a "
                         "folder (served alone, with its cached EAGLE drafter if any)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--methods", default="ar,draft,ngram,medusa")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: 2 x concurrency, >= 4)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=0,
                    help="each engine's max batch (default: the concurrency; a server's is its --max-batch)")
    ap.add_argument("--profile", action="store_true", help="cProfile one run per method and concurrency")
    ap.add_argument("--mix", action="store_true", help="bench serve's prompt mix; adds the method 'policy'")
    ap.add_argument("--policy", default=None, help="policy file for 'policy' (default: the server's default)")
    ap.add_argument("--suite", choices=("code", "chat"), default="code",
                    help="code: the bundled code prompts, greedy; chat: the chat-model mixed suite in the model's "
                         "chat template (conversation turns, code, factual, creative sampled), each method on its "
                         "own engine")
    ap.add_argument("--library", action="store_true",
                    help="also decode the same prompts with Decoder.generate, one at a time, and compare")
    ap.add_argument("--kv-cache-mb", default="64", type=_budget,
                    help="each engine's KV budget in MB, or 'auto': a server's default (`auto_kv_cache_mb`: "
                         "max batch x full context, twice over, which keeps a run's prompts in the prefix "
                         "cache as `bench serve`'s server does)")
    args = ap.parse_args()
    if args.max_batch < 0:
        ap.error(f"--max-batch must be >= 1 (0: the concurrency), got {args.max_batch}")
    methods = args.methods.split(",")
    if args.mix and args.suite != "code":
        ap.error("--mix sends bench serve's prompt mix; it takes no --suite")
    if args.library and (args.mix or args.suite != "code" or args.profile):
        ap.error("--library compares on the code suite's greedy prompts: not with --mix, --suite chat or --profile")
    unknown = [m for m in methods if m not in METHOD_SETTINGS and not (args.mix and m == "policy")]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHOD_SETTINGS)}"
                 + (", policy" if args.mix else " (policy needs --mix)"))
    torch.set_num_threads(args.threads)
    from specops.decoder import Decoder

    try:
        dec = Decoder.from_pretrained(args.model)
    except Exception as exc:  # a name it cannot pull, a folder it cannot load: say so, no traceback
        ap.error(f"cannot load --model {args.model!r}: {exc}")
    missing = [m for m in methods if m in ("draft", "medusa", "eagle") and getattr(dec, m, None) is None]
    if missing:
        ap.error(f"--model {args.model!r} has no part for method(s) {', '.join(missing)}")
    print(f"load: {os.getloadavg()} (tok/cpu-s: output tokens per CPU second of this process, robust to other load)")
    for c in [int(x) for x in args.concurrency.split(",")]:
        n = args.requests or max(4, 2 * c)
        try:
            mix = (mix_requests(dec, n, args.policy) if args.mix
                   else chat_requests(dec, n) if args.suite == "chat" else None)
        except ValueError as exc:
            ap.error(str(exc))
        ps = prompts(dec, n) if mix is None else [ids for ids, _, _ in mix]
        # --mix: one engine per method; otherwise all methods share one (as before)
        budget = None if args.kv_cache_mb == "auto" else float(args.kv_cache_mb)
        max_batch = args.max_batch or max(c, 1)
        shared = Engine(dec, max_batch=max_batch, kv_cache_mb=budget) if mix is None else None
        if shared is None and budget is None and len(methods) > 1:
            probe = Engine(dec, max_batch=max_batch, kv_cache_mb=None, calibrate=False)  # the budget it chose
            budget = shared_auto_budget(probe.kv_budget, len(methods))
            del probe
        engines = {m: shared if shared is not None else Engine(dec, max_batch=max_batch, kv_cache_mb=budget)
                   for m in methods}
        for e in {id(e): e for e in engines.values()}.values():
            run(e, "ar", ps[: min(n, c)], c, 8)  # warm-up
        if args.profile:
            for m in methods:
                RECORDS.clear()
                prof = cProfile.Profile()
                prof.enable()
                sec, toks, _ = run(engines[m], m, ps, c, args.max_tokens, mix)
                prof.disable()
                print(f"\n=== profile c={c} {m}: {toks / sec:.1f} tok/s")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
                print(meters(engines[m], c))
                fwd = sum(r.target_forwards for r in RECORDS)
                print(f"drafted/forward={sum(r.drafted for r in RECORDS) / max(fwd, 1):.2f} "
                      f"accepted/forward={sum(r.accepted for r in RECORDS) / max(fwd, 1):.2f} "
                      f"draft_s={sum(r.draft_s for r in RECORDS):.2f} verify_s={sum(r.verify_s for r in RECORDS):.2f}")
            continue
        rates: dict[str, list[float]] = {m: [] for m in methods}
        cpu_rates: dict[str, list[float]] = {m: [] for m in methods}
        records: dict[str, list] = {m: [] for m in methods}
        library: dict[str, list[float]] = {m: [] for m in methods}
        if args.library:
            for m in methods:
                run_library(dec, m, ps[:1], 8)  # warm-up
        for r in range(args.repeats):
            for m in (methods if r % 2 == 0 else methods[::-1]):  # alternated: the host drifts over minutes
                RECORDS.clear()
                sec, toks, cpu = run(engines[m], m, ps, c, args.max_tokens, mix)
                rates[m].append(toks / sec)
                cpu_rates[m].append(toks / cpu)
                records[m].extend(RECORDS)
                if args.library:
                    sec, toks = run_library(dec, m, ps, args.max_tokens)
                    library[m].append(toks / sec)
        ar = statistics.median(rates["ar"]) if "ar" in rates else None
        ar_cpu = statistics.median(cpu_rates["ar"]) if "ar" in rates else None
        for m in methods:
            med, cmed = statistics.median(rates[m]), statistics.median(cpu_rates[m])
            ratio = f"{med / ar:.2f}x" if ar else ""
            cratio = f"{cmed / ar_cpu:.2f}x" if ar_cpu else ""
            pair = f" {paired(rates[m], rates['ar'])}" if ar and m != "ar" else ""
            print(f"c={c:3d} {m:7s} wall {med:7.1f} tok/s {ratio:6s} cpu {cmed:7.1f} tok/cpu-s {cratio:6s} "
                  f"wall runs={[round(r, 1) for r in rates[m]]}{pair}")
        for m in methods if args.library else ():
            print(f"c={c:3d} {m:7s} library {statistics.median(library[m]):7.1f} tok/s (Decoder.generate, one at "
                  f"a time); engine / library {paired(rates[m], library[m])}")
        for m in methods:
            print(f"c={c:3d} {m:7s} {forward_split(records[m])}")
            if m != "ar":
                print(f"c={c:3d} {m:7s} {planner_line(engines[m])}")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
