"""Engine-only throughput: output tokens/s per method and concurrency, and a step profile.

No HTTP: a `specops.serving.engine.Engine` over the bundled models, ``concurrency``
requests kept in flight (a finished one is replaced at once), greedy, code prompts.
Methods are run interleaved, repeated ``--repeats`` times; the median is reported
with the ratio to ``ar`` at the same concurrency.

    python -m specops.bench.engine_bench --concurrency 1,16 --repeats 3
    python -m specops.bench.engine_bench --profile --concurrency 1,16   # where a step's time goes
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from specops.serving.engine import Engine
from specops.serving.sequence import SamplingParams, SpecSettings

RECORDS: list = []  # finished requests' DecodeStats (the profile mode reports drafting from them)
METHOD_SETTINGS = {
    "ar": SpecSettings(method="ar"),
    "draft": SpecSettings(method="draft", gamma=6),
    "ngram": SpecSettings(method="ngram", gamma=6),
    "medusa": SpecSettings(method="medusa", tree_size=16),
}


def prompts(dec, n: int) -> list[list[int]]:
    from specops.bench.suites import builtin_suite

    texts = [p.text for p in builtin_suite("code")]
    return [dec.tokenizer.encode(texts[i % len(texts)]) for i in range(n)]


def run(eng: Engine, method: str, prompt_ids: list[list[int]], concurrency: int,
        max_tokens: int) -> tuple[float, int, float]:
    """Wall seconds, output tokens and process CPU seconds for all prompts with ``concurrency`` in flight."""
    pending = list(enumerate(prompt_ids))
    live = 0
    tokens = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or eng.has_unfinished():
        while pending and live < concurrency:
            i, p = pending.pop(0)
            eng.add(f"{method}-{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), METHOD_SETTINGS[method])
            live += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            live -= out.finished
            if out.finished and out.record is not None:
                RECORDS.append(out.record)
    return time.perf_counter() - t0, tokens, time.process_time() - c0


def meters(eng: Engine, c: int) -> str:
    """What the planner believes (ms): verify and draft-round costs, overheads, fixed host time."""
    ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
    parts = [f"verify(B={c},T={c})={ms(eng.cost.predict(c, c))}", f"verify(B={c},T={5 * c})={ms(eng.cost.predict(c, 5 * c))}"]
    if eng.draft is not None:
        parts.append(f"draft_round(B={c})={ms(eng.draft_cost.predict(c, c))}")
    parts += [f"overhead[{m}]={ms(v.value())}" for m, v in eng.overhead.items()]
    parts.append(f"fixed(B={c})={ms(eng._fixed_s(c))}")
    return "planner ms: " + " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--methods", default="ar,draft,ngram,medusa")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: 2 x concurrency, >= 4)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile one run per method and concurrency")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specops.decoder import Decoder

    dec = Decoder.from_pretrained("bundled")
    methods = args.methods.split(",")
    print(f"load: {os.getloadavg()} (tok/cpu-s: output tokens per CPU second of this process, robust to other load)")
    for c in [int(x) for x in args.concurrency.split(",")]:
        n = args.requests or max(4, 2 * c)
        ps = prompts(dec, n)
        eng = Engine(dec, max_batch=max(c, 1), kv_cache_mb=64)
        run(eng, "ar", ps[: min(n, c)], c, 8)  # warm-up
        if args.profile:
            for m in methods:
                RECORDS.clear()
                prof = cProfile.Profile()
                prof.enable()
                sec, toks, _ = run(eng, m, ps, c, args.max_tokens)
                prof.disable()
                print(f"\n=== profile c={c} {m}: {toks / sec:.1f} tok/s")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
                print(meters(eng, c))
                fwd = sum(r.target_forwards for r in RECORDS)
                print(f"drafted/forward={sum(r.drafted for r in RECORDS) / max(fwd, 1):.2f} "
                      f"accepted/forward={sum(r.accepted for r in RECORDS) / max(fwd, 1):.2f} "
                      f"draft_s={sum(r.draft_s for r in RECORDS):.2f} verify_s={sum(r.verify_s for r in RECORDS):.2f}")
            continue
        rates: dict[str, list[float]] = {m: [] for m in methods}
        cpu_rates: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m in methods:
                sec, toks, cpu = run(eng, m, ps, c, args.max_tokens)
                rates[m].append(toks / sec)
                cpu_rates[m].append(toks / cpu)
        ar = statistics.median(rates["ar"]) if "ar" in rates else None
        ar_cpu = statistics.median(cpu_rates["ar"]) if "ar" in rates else None
        for m in methods:
            med, cmed = statistics.median(rates[m]), statistics.median(cpu_rates[m])
            ratio = f"{med / ar:.2f}x" if ar else ""
            cratio = f"{cmed / ar_cpu:.2f}x" if ar_cpu else ""
            print(f"c={c:3d} {m:7s} wall {med:7.1f} tok/s {ratio:6s} cpu {cmed:7.1f} tok/cpu-s {cratio:6s} "
                  f"wall runs={[round(r, 1) for r in rates[m]]}")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
