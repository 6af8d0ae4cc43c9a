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


def run(eng: Engine, method: str, prompt_ids: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens for all prompts with ``concurrency`` in flight."""
    pending = list(enumerate(prompt_ids))
    live = 0
    tokens = 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and live < concurrency:
            i, p = pending.pop(0)
            eng.add(f"{method}-{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), METHOD_SETTINGS[method])
            live += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            live -= out.finished
    return time.perf_counter() - t0, tokens


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
    print(f"load: {os.getloadavg()}")
    for c in [int(x) for x in args.concurrency.split(",")]:
        n = args.requests or max(4, 2 * c)
        ps = prompts(dec, n)
        eng = Engine(dec, max_batch=max(c, 1), kv_cache_mb=64)
        run(eng, "ar", ps[: min(n, c)], c, 8)  # warm-up
        if args.profile:
            for m in methods:
                prof = cProfile.Profile()
                prof.enable()
                sec, toks = run(eng, m, ps, c, args.max_tokens)
                prof.disable()
                print(f"\n=== profile c={c} {m}: {toks / sec:.1f} tok/s")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            continue
        rates: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m in methods:
                sec, toks = run(eng, m, ps, c, args.max_tokens)
                rates[m].append(toks / sec)
        ar = statistics.median(rates["ar"]) if "ar" in rates else None
        for m in methods:
            med = statistics.median(rates[m])
            ratio = f"{med / ar:.2f}x" if ar else ""
            print(f"c={c:3d} {m:7s} {med:8.1f} tok/s {ratio}  runs={[round(r, 1) for r in rates[m]]}")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
