"""Decode deadlines that expire in the middle of a request, for draft, ngram and medusa.

Past the deadline a request must go on with plain decoding on the same cache: the
output equals plain greedy decoding token for token, every target forward that starts
after the deadline verifies one position (``T == 1``), speculation did run before it,
and ``stats.fallback_reason == "deadline"``. A fake clock (`tests.decoder.clocked`)
makes time pass only when a model runs or a draft is made (1 s per target forward,
0.25 s per draft forward, 0.5 s per n-gram lookup), so a sweep of deadlines lands in
every phase of a step, including drafting (a deadline that passes while drafting must
not end in ``ValueError`` when verification re-checks it).
"""

from __future__ import annotations

import pytest

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.spec.ngram import NgramIndex
from specops.models.loading import load_runner
from tests.decoder.clocked import ClockedRunner, FakeClock, Forward
from tests.decoder.tiny_models import VOCAB, hf_greedy, perturbed, tiny_llama

PROMPT = [(5 * i) % VOCAB for i in range(VOCAB + 1)]  # every token, then the first again: lookup always drafts
NEW = 24


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=21)
    return target, perturbed(target, noise=0.05, seed=22), MedusaHeads.from_model(target, num_heads=3)


def clocked_decoder(models, clock: FakeClock) -> tuple[Decoder, ClockedRunner]:
    target, draft, heads = models
    runner = ClockedRunner(load_runner(target), clock)
    dec = Decoder(runner, draft=ClockedRunner(load_runner(draft), clock, forward_s=0.25), medusa=heads)
    dec.generate(PROMPT, method="ngram", max_new_tokens=1)  # the one-off speed-up calibration, out of the way
    return dec, runner


def check_tail_is_plain(forwards: list[Forward], deadline_s: float) -> None:
    """``forwards``: the request's target forwards, prefill first (the deadline clock starts just before it)."""
    deadline = forwards[0].start + deadline_s
    steps = forwards[1:]
    before = [f.width for f in steps if f.start < deadline]
    after = [f.width for f in steps if f.start > deadline]
    assert any(w > 1 for w in before), f"no speculation before the deadline: {before}"
    assert after, "the deadline did not expire mid-request"
    assert all(w == 1 for w in after), f"speculative forwards after the deadline: {after}"


# deadlines k + f: f falls in every phase of a step (drafting, verifying), never on a clock tick
FRACTIONS = (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.9)


@pytest.mark.parametrize("method, whole_seconds", [("draft", (3, 4, 6)), ("ngram", (2, 3, 4)), ("medusa", (2, 3, 4))])
def test_deadline_mid_request_switches_to_plain_decoding_exactly(models, monkeypatch, method, whole_seconds):
    clock = FakeClock()
    clock.install(monkeypatch)
    monkeypatch.setattr(NgramIndex, "propose", clock.slow(NgramIndex.propose, 0.5))
    dec, runner = clocked_decoder(models, clock)
    ref = dec.generate(PROMPT, method="ar", max_new_tokens=NEW).tokens
    assert ref == hf_greedy(models[0], PROMPT, NEW)
    extra = {"tree": "small"} if method == "medusa" else {"gamma": 3}  # a fixed tree: no cost probe
    for k in whole_seconds:
        for f in FRACTIONS:
            deadline_s = k + f
            start = len(runner.log)
            out = dec.generate(PROMPT, method=method, max_new_tokens=NEW, deadline_s=deadline_s, **extra)
            label = (method, deadline_s)
            assert out.tokens == ref, label
            assert out.stats.fallback_reason == "deadline", label
            check_tail_is_plain(runner.log[start:], deadline_s)
            assert 0 < out.stats.drafted and out.stats.gamma_trace[-1] == 0, label
    # the same requests without a deadline speculate to the end and report no fallback
    on_time = dec.generate(PROMPT, method=method, max_new_tokens=NEW, deadline_s=3600.0, **extra)
    assert on_time.tokens == ref and on_time.stats.fallback_reason is None


def test_sampled_request_past_its_deadline_keeps_its_seed_reproducible(models, monkeypatch):
    """With sampling too, a deadline mid-request ends in plain steps, and the same seed and
    the same (fake) timing give the same tokens."""
    outs = []
    for _ in range(2):
        clock = FakeClock()
        clock.install(monkeypatch)
        dec, runner = clocked_decoder(models, clock)
        start = len(runner.log)
        out = dec.generate(PROMPT, method="draft", gamma=4, max_new_tokens=NEW, deadline_s=4.1,
                           temperature=1.0, seed=7)
        assert out.stats.fallback_reason == "deadline" and len(out.tokens) == NEW
        check_tail_is_plain(runner.log[start:], 4.1)
        outs.append(out.tokens)
    assert outs[0] == outs[1]


def test_slow_draft_past_the_deadline_does_not_crash(models):
    """The same in real time: every draft forward sleeps 20 ms and the request
    has 50 ms, so the deadline passes while a block is being drafted."""
    target, draft, _ = models
    clock = FakeClock()  # not installed: real time
    dec = Decoder(target, draft=ClockedRunner(load_runner(draft), clock, sleep_s=0.02))
    ref = dec.generate(PROMPT, method="ar", max_new_tokens=20).tokens
    out = dec.generate(PROMPT, method="draft", gamma=4, max_new_tokens=20, deadline_s=0.05)
    assert out.tokens == ref
    assert out.stats.fallback_reason == "deadline"
    # 20 tokens need >= 4 drafted blocks of 4 sleeping forwards (>= 320 ms) without a deadline;
    # with it, drafting stops after the first block or two
    assert out.stats.draft_forwards <= 1 + 2 * 4, out.stats.draft_forwards


@pytest.mark.parametrize("how", [{"method": "auto"}, {"method": "draft", "pipeline": "async"}])
def test_slow_draft_past_the_deadline_does_not_crash_auto_or_async(models, monkeypatch, how):
    """The same reproduction for the other drafters that verify a model-drafted block: `auto`
    (made to take its draft option whenever it can) and the asynchronous pipeline. Past the
    deadline the step runs plainly."""
    from specops.spec import auto

    choose = auto.Chooser.choose
    monkeypatch.setattr(auto.Chooser, "choose", lambda self, available: "draft" if "draft" in available
                        else choose(self, available))
    target, draft, heads = models
    clock = FakeClock()  # not installed: real time
    dec = Decoder(target, draft=ClockedRunner(load_runner(draft), clock, sleep_s=0.02))
    ref = dec.generate(PROMPT, method="ar", max_new_tokens=20).tokens
    for deadline_s in (0.01, 0.03, 0.05, 0.08):
        out = dec.generate(PROMPT, gamma=4, max_new_tokens=20, deadline_s=deadline_s, **how)
        assert out.tokens == ref, (how, deadline_s)
        assert out.stats.fallback_reason == "deadline", (how, deadline_s)
