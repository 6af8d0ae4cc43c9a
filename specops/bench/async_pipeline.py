"""Synchronous vs asynchronous draft pipeline, same draft, same γ, same prompts, one process.

``python -m specops.bench.async_pipeline [--gamma 4] [--prompts 6] [--tokens 64] [--repeats 3]``

The bundled target and draft decode the held-out code suite greedily with ``ar``,
``draft`` (sync, the target using ``--threads``) and ``draft`` with
``pipeline="async"`` (the target using ``threads - draft_threads``, the draft thread
``--draft-threads``), interleaved per prompt. Reports median tokens/s over repeats,
the speed-up against ``ar`` and whether the outputs equal ``ar``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def run(gamma: int = 4, prompts: int = 6, tokens: int = 64, repeats: int = 3, threads: int = 2,
        draft_threads: int = 1) -> dict:
    from specops.bench.suites import builtin_suite
    from specops.decoder import Decoder

    dec = Decoder.from_pretrained("bundled")
    texts = [p.text for p in builtin_suite("code")[:prompts]]
    ids = [dec.tokenizer.encode(t)[-200:] for t in texts]
    target_threads = max(1, threads - draft_threads)
    variants = {
        "ar": (threads, {"method": "ar"}),
        "draft-sync": (threads, {"method": "draft", "gamma": gamma}),
        "draft-sync-1t": (target_threads, {"method": "draft", "gamma": gamma}),
        "draft-async": (target_threads, {"method": "draft", "gamma": gamma, "pipeline": "async",
                                         "draft_threads": draft_threads}),
    }
    for name, (n, kw) in variants.items():  # warm-up
        torch.set_num_threads(n)
        dec.generate(ids[0], max_new_tokens=8, **kw)
    secs = {k: [0.0] * repeats for k in variants}
    toks = {k: [0] * repeats for k in variants}
    accepted = {k: [0, 0] for k in variants}
    exact = {k: True for k in variants}
    for r in range(repeats):
        for p in ids:
            ref = None
            for name, (n, kw) in variants.items():
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                out = dec.generate(p, max_new_tokens=tokens, **kw)
                secs[name][r] += time.perf_counter() - t0
                toks[name][r] += len(out.tokens)
                accepted[name][0] += out.stats.accepted
                accepted[name][1] += out.stats.drafted
                ref = out.tokens if ref is None else ref
                exact[name] &= out.tokens == ref
    rows = {}
    for name in variants:
        tps = statistics.median(t / s for t, s in zip(toks[name], secs[name]))
        rows[name] = {"tokens_per_s": round(tps, 2), "target_threads": variants[name][0],
                      "acceptance": round(accepted[name][0] / accepted[name][1], 4) if accepted[name][1] else None,
                      "exact_vs_ar": exact[name]}
    base = rows["ar"]["tokens_per_s"]
    for row in rows.values():
        row["speedup_vs_ar"] = round(row["tokens_per_s"] / base, 3)
    return {"gamma": gamma, "prompts": prompts, "tokens": tokens, "repeats": repeats, "threads": threads,
            "draft_threads": draft_threads, "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--gamma", 4), ("--prompts", 6), ("--tokens", 64), ("--repeats", 3), ("--threads", 2),
                          ("--draft-threads", 1)):
        parser.add_argument(flag, type=int, default=default)
    a = parser.parse_args()
    if min(a.gamma, a.prompts, a.tokens, a.repeats, a.threads, a.draft_threads) < 1:
        parser.error("every option must be >= 1")
    print(json.dumps(run(a.gamma, a.prompts, a.tokens, a.repeats, a.threads, a.draft_threads), indent=2))


if __name__ == "__main__":
    main()
