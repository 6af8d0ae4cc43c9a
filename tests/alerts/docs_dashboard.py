"""The dashboard snapshot of docs/ops.md: a shipped policy falling back and returning on a live stack.

The live stack of `tests.alerts.live_stack` (``specops serve`` on the bundled models, ``specops
controller run``, a real Prometheus) runs ``examples/policies/chat.yaml`` with its own thresholds,
its durations scaled by ``--time-factor`` as ``specops demo`` does (`fast_policy_text`, so a 60 s
``for`` plays out in 6 s). Its ``summarise`` class speculates with n-gram lookups, which pay where
the reply copies the prompt. The traffic, from three HTTP clients (two ``summarise``, one chat
client sending prose to the draft-model ``chat`` class), changes in three phases:

1. ``copy``: summarise prompts whose notes repeat (the bundled models continue the repetition: n-gram
   acceptance ~0.7 on them);
2. ``prose``: summarise prompts of ordinary prose (n-gram acceptance ~0.33): the policy's
   ``low-acceptance`` rule (< 0.5 for its ``for_s``) fires and the controller falls the class back;
   its probes (the class's ``probe_fraction``) keep speculating;
3. ``copy`` again: the class speculates (the probes, at the class's minimum γ, may already pay on
   prose and turn it back on earlier) and the controller raises γ again.

Run (about five minutes)::

    PYTHONPATH=. python -m tests.alerts.docs_dashboard --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from tests.alerts.live_stack import ROOT, LiveStack

POLICY_FILE = ROOT / "examples" / "policies" / "chat.yaml"
WORDS = ("the report said that sales rose in the north while costs fell in the south and the board approved "
         "the plan for next year after a long debate").split()
PHASES = (("copy", 70.0), ("prose", 80.0), ("copy", 130.0))


def copy_prompt(rng: random.Random) -> str:
    """Notes that repeat one sentence, cut mid-sentence: the reply continues the repetition."""
    sentence = " ".join(rng.choice(WORDS) for _ in range(14)) + ". "
    return "Summarise the notes below.\n\nNotes: " + sentence * 6 + sentence[: len(sentence) // 2]


def prose_prompt(rng: random.Random, pool: list[str]) -> str:
    return "Summarise the notes below.\n\nNotes: " + rng.choice(pool)


def run_phases(stack: LiveStack, phases=PHASES, max_tokens: int = 48) -> list[tuple[str, float, int]]:
    """Drive the stack through ``phases`` ((kind, seconds)); returns (kind, started, requests) per phase."""
    import httpx

    from specops.bench.suites import builtin_suite

    assert stack.server is not None
    pool = [p.text for p in builtin_suite("prose", seed=0)]
    chat = [p.text for p in builtin_suite("prose", seed=1)]
    out = []
    errors: list[str] = []
    for kind, seconds in phases:
        deadline = time.monotonic() + seconds
        served = [0, 0, 0]
        started = time.time()

        def client(k: int) -> None:
            rng = random.Random(k * 7919 + len(out))
            with httpx.Client(base_url=stack.server.url, timeout=120) as http:
                while time.monotonic() < deadline and not errors:
                    if k < 2:
                        prompt = copy_prompt(rng) if kind == "copy" else prose_prompt(rng, pool)
                        meta = {"task": "summarise"}
                    else:
                        prompt, meta = rng.choice(chat), {}
                    body = {"model": "bundled", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "metadata": meta}
                    r = http.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code} {r.text[:300]}")
                        return
                    served[k] += 1

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 120)
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}\n{stack.server.log()}")
        out.append((kind, started, sum(served)))
        print(f"phase {kind}: {seconds:.0f}s, {sum(served)} requests", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--time-factor", type=float, default=0.1)
    args = parser.parse_args(argv)
    from specops.alerts.prometheus_api import PrometheusClient
    from specops.alerts.snapshot import snapshot
    from specops.demo_ops import fast_policy_text

    policy = fast_policy_text(POLICY_FILE, args.time_factor)
    with tempfile.TemporaryDirectory(prefix="specops-docs-dash-") as tmp:
        stack = LiveStack(Path(tmp), clients=3, policy=policy, controller_window_s=30).start()
        try:
            begin = time.time()
            run_phases(stack)
            time.sleep(3)
            events = stack.store.read_audit(1000)
            counts = snapshot(PrometheusClient(stack.prometheus_url), args.out, range_s=time.time() - begin + 5,
                              rate_window="20s")
        finally:
            stack.stop()
    for e in events:
        if e.get("actor") == "controller" and "fallback" in str(e.get("kind", "")):
            print(e.get("kind"), e.get("class") or e.get("request_class"), str(e.get("reason", ""))[:120])
    print(f"wrote {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
