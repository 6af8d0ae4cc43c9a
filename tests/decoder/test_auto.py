"""method="auto": exact greedy output whatever it picks, a sampled distribution that is the
target's, and choices that follow the measured acceptance."""

from __future__ import annotations

import random

import pytest
import torch

from specops.decoder import Decoder
from specops.spec.auto import ESTIMATES, AutoEstimates, Chooser, Costs, OptionEstimate, ngram_tier
from specops.spec.tree_size import VerifyCostCurve
from tests.decoder.test_medusa_bundled import code_prompts


@pytest.fixture(scope="module")
def bundled():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Decoder.from_pretrained("bundled")
    torch.set_num_threads(before)


def test_auto_greedy_equals_ar_on_code_and_random_prompts(bundled):
    rng = random.Random(3)
    vocab = bundled.target.vocab_size
    prompts = code_prompts(bundled, 6)
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    used: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        max_new = 40 if i < 6 else rng.randint(1, 20)
        eos = None if i % 4 else rng.randrange(vocab)
        ar = bundled.generate(prompt, method="ar", max_new_tokens=max_new, eos_token_id=eos)
        auto = bundled.generate(prompt, method="auto", max_new_tokens=max_new, eos_token_id=eos)
        assert auto.tokens == ar.tokens, f"prompt {i}"
        assert auto.stats.method == "auto" and auto.stats.stop_reason == ar.stats.stop_reason
        assert sum(auto.stats.auto_steps.values()) == auto.stats.steps
        for name, n in auto.stats.auto_steps.items():
            used[name] = used.get(name, 0) + n
    assert {"ngram", "draft", "medusa"} <= set(used), used  # every drafter was at least measured


def test_auto_past_deadline_decodes_plainly(bundled):
    prompt = code_prompts(bundled, 1)[0]
    ar = bundled.generate(prompt, method="ar", max_new_tokens=24)
    out = bundled.generate(prompt, method="auto", max_new_tokens=24, deadline_s=1e-9)
    assert out.tokens == ar.tokens
    assert out.stats.fallback_reason == "deadline"
    assert set(out.stats.auto_steps) == {"plain"}


def test_auto_rejects_medusa_only_options(bundled):
    from specops.spec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="heads"):
        bundled.generate([5, 6, 7], method="auto", heads=2)


def _offered(monkeypatch, **kwargs) -> set[str]:
    """The options auto offered its chooser over a few greedy requests on tiny models with Medusa
    heads and an EAGLE drafter loaded (the chooser picks uniformly, so every offered drafter runs)."""
    from specops.models.eagle_model import EagleDrafter
    from specops.models.fast_llama import FastLlamaRunner
    from specops.models.medusa_heads import MedusaHeads
    from specops.spec import auto
    from specops.spec.sampling import SamplingConfig, make_generator
    from tests.decoder.medusa_models import tiny_model

    model = tiny_model("llama", vocab=6, seed=3)
    heads = MedusaHeads.from_model(model, num_heads=2)
    eagle = EagleDrafter.for_target(model, seed=5).eval()
    offered: set[str] = set()
    rng = random.Random(1)

    def choose(self, available: dict[str, int]) -> str:
        self.step += 1
        offered.update(available)
        return rng.choice(sorted(available))

    monkeypatch.setattr(auto.Chooser, "choose", choose)
    for i in range(4):
        _, stats = auto.generate_auto(FastLlamaRunner(model), torch.tensor([[1, 4, 2, 1, 4]]), draft=None,
                                      heads=heads, sampling=SamplingConfig(), generator=make_generator(i),
                                      max_new_tokens=12, estimates=AutoEstimates(), eagle=eagle, **kwargs)
        assert set(stats.auto_steps) <= offered
    return offered


def test_auto_leaves_medusa_out_beside_an_eagle_drafter(monkeypatch):
    assert "eagle" in (offered := _offered(monkeypatch)) and "medusa" not in offered, offered
    assert {"eagle", "medusa"} <= (offered := _offered(monkeypatch, medusa_beside_eagle=True)), offered


def _costs() -> Costs:
    curve = VerifyCostCurve(sizes=(1, 2, 4, 8), seconds=(1.0, 1.1, 1.2, 1.4))
    return Costs(verify=curve, draft_token_s=0.1, heads_s=0.05, tree_nodes=8)


def test_chooser_prefers_what_accepts_and_probes_the_rest_rarely():
    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    chooser = Chooser(est, _costs())
    for _ in range(30):  # ngram accepts everything it drafts, the draft model nothing
        est["ngram"].update(drafted=4, accepted=4, emitted=5)
        est["draft"].update(drafted=4, accepted=0, emitted=1)
        est["medusa"].update(drafted=3, accepted=0, emitted=1)
    picks = []
    for _ in range(900):
        p = chooser.choose({"plain": 0, "ngram": 4, "draft": 4, "medusa": 3})
        chooser.last_used[p] = chooser.step
        picks.append(p)
    counts = {p: picks.count(p) for p in set(picks)}
    assert counts["ngram"] > 880, counts
    assert all(counts.get(name, 0) >= 1 for name in ("plain", "draft", "medusa")), counts  # still probed


def test_an_estimate_from_one_unlucky_block_is_measured_again_soon():
    """One rejected draft block leaves the draft model's acceptance at 0.35 over ~3 trials, and
    Medusa looks 2.6x better: its budgeted wait alone was ~320 steps. Read at its upper bound the
    estimate is a guess, so it is tried again within PROBE_EVERY steps; after blocks that really
    are accepted it wins the choice."""
    from specops.spec.auto import PROBE_EVERY

    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    est["draft"].update(drafted=4, accepted=0, emitted=1)
    for _ in range(5):
        est["medusa"].update(drafted=3, accepted=3, emitted=4)
    chooser = Chooser(est, _costs())
    assert chooser.rate("medusa", 3) > 2 * chooser.rate("draft", 4)
    picks = []
    for _ in range(150):
        p = chooser.choose({"plain": 0, "draft": 4, "medusa": 3})
        chooser.last_used[p] = chooser.step
        picks.append(p)
        if p == "draft":
            est["draft"].update(drafted=4, accepted=4, emitted=5)  # the draft model really accepts
    assert "draft" in picks[: PROBE_EVERY + 2], picks  # tried again soon, not in ~320 steps
    assert picks[-10:] == ["draft"] * 10, picks  # and chosen once measured


def test_plain_decoding_is_probed_only_every_max_wait_steps():
    """Plain decoding has no acceptance to learn: while a drafter is clearly best, a plain step
    comes at most once per PROBE_MAX_WAIT steps (its probes re-measure its cost scale only),
    where a budgeted wait would have tried it every ~30."""
    from specops.spec.auto import PROBE_MAX_WAIT

    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    for _ in range(30):  # the draft model ~1.17x plain on the model's costs: a budgeted wait of ~35 steps
        est["draft"].update(drafted=4, accepted=1, emitted=2)
    chooser = Chooser(est, _costs())
    assert 1.1 < chooser.rate("draft", 4) / chooser.rate("plain", 0) < 1.3
    picks = []
    for _ in range(3 * PROBE_MAX_WAIT):
        p = chooser.choose({"plain": 0, "draft": 4})
        chooser.last_used[p] = chooser.step
        picks.append(p)
    plain_at = [i for i, p in enumerate(picks) if p == "plain"]
    assert 2 <= len(plain_at) <= 3, plain_at
    assert all(b - a >= PROBE_MAX_WAIT for a, b in zip(plain_at, plain_at[1:])), plain_at


def test_the_hidden_state_is_read_only_when_a_step_asks_for_it(bundled):
    """`TargetVerifier.hidden_from`: the verifier keeps where the hidden state is, not a copy;
    the first read takes it, and a newer step's state replaces an unread one."""
    from specops.spec.sampling import SamplingConfig
    from specops.spec.speculation import TargetVerifier
    from specops.spec.stats import DecodeStats

    target = bundled.target
    prompt = code_prompts(bundled, 1)[0]
    v = TargetVerifier(target, prompt, sampling=SamplingConfig(temperature=0.0), generator=torch.Generator(),
                       max_new_tokens=8, eos_token_id=None, stats=DecodeStats(method="auto"), keep_hidden=True)
    v.prefill()
    assert v.has_hidden
    reads = []

    def source(value):
        def read():
            reads.append(value)
            return torch.full((4,), float(value))
        return read

    v.hidden_from(source(1))
    v.hidden_from(source(2))
    assert v.has_hidden and reads == []  # nothing read yet, the first source never
    assert v.hidden[0] == 2.0 and v.hidden[0] == 2.0 and reads == [2]  # read once, then kept
    result = v.verify([], None)  # a plain step on the fast runner: the block verifier's buffer is the source
    assert len(result.emitted) == 1
    lazy = v.hidden.clone()  # read now, from the step's buffer: the state of the prompt's last token
    ref = bundled.generate(prompt, method="ar", max_new_tokens=1)
    assert ref.tokens == v.output
    target.reset(1)
    full = target.forward(torch.tensor([prompt]), need_hidden=True)
    assert torch.allclose(lazy, full.hidden[0, -1], atol=1e-5)


def test_an_ngram_step_reads_the_acceptance_of_its_matchs_tier():
    """Short matches' continuations are rejected, long ones copied whole: with one estimate for
    both n-gram looked worse than the draft model everywhere; by tier it wins after a long match
    and the draft model drafts after a short one."""
    est = {name: OptionEstimate() for name in ESTIMATES}
    for _ in range(30):
        est["ngram:1"].update(drafted=1, accepted=0, emitted=1)
        est["ngram:16+"].update(drafted=8, accepted=8, emitted=9)
        est["draft"].update(drafted=4, accepted=2, emitted=3)
    chooser = Chooser(est, _costs())
    picks = {}
    for length, drafted in ((1, 1), (20, 8)):
        chooser.keys["ngram"] = ngram_tier(length)
        runs = []
        for _ in range(60):
            p = chooser.choose({"plain": 0, "ngram": drafted, "draft": 4})
            chooser.last_used[p] = chooser.step
            runs.append(p)
        picks[length] = max(set(runs), key=runs.count)
    assert picks == {1: "draft", 20: "ngram"}
    assert [ngram_tier(n) for n in (0, 1, 2, 3, 7, 8, 15, 16, 40)] == [
        "ngram:store", "ngram:1", "ngram:2", "ngram:3-7", "ngram:3-7", "ngram:8-15", "ngram:8-15", "ngram:16+",
        "ngram:16+"]


def test_an_ngram_step_is_counted_in_its_tier_and_carried_to_the_next_request(bundled):
    estimates, before = AutoEstimates(), bundled.auto_estimates
    bundled.auto_estimates = estimates
    try:
        out = bundled.generate(code_prompts(bundled, 1)[0], method="auto", max_new_tokens=48)
    finally:
        bundled.auto_estimates = before
    assert out.stats.auto_steps.get("ngram", 0) > 0
    carried = estimates.start(greedy=True)
    tiers = [key for key in ESTIMATES if key.startswith("ngram:")]
    assert sum(carried[key].steps for key in tiers) > 0  # n-gram steps land in their tiers' estimates
    assert carried["ngram"].steps == 0


def test_chooser_picks_plain_when_nothing_accepts():
    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    for _ in range(30):
        for name in ("ngram", "draft", "medusa"):
            est[name].update(drafted=3, accepted=0, emitted=1)
    chooser = Chooser(est, _costs())
    picks = []
    for _ in range(200):
        p = chooser.choose({"plain": 0, "ngram": 3, "draft": 4, "medusa": 3})
        chooser.last_used[p] = chooser.step
        picks.append(p)
    assert picks.count("plain") >= 190  # speculation that never pays is only probed


def test_estimates_carry_over_between_requests_per_sampling_mode():
    estimates = AutoEstimates()
    request = estimates.start(greedy=True)
    request["ngram"].update(drafted=4, accepted=4, emitted=5)
    estimates.finish(True, request)
    assert estimates.start(greedy=True)["ngram"].steps == 1
    assert estimates.start(greedy=False)["ngram"].steps == 0


def test_one_requests_end_moves_where_the_next_starts_only_by_the_carry_weight():
    """A request whose Medusa steps ended poorly (1.8 tokens per step, after requests at 4.0)
    moves the starting estimate by CARRY_WEIGHT of the difference, not all the way: the next
    request (maybe of another kind) does not start from one request's end."""
    from specops.spec.auto import CARRY_WEIGHT

    estimates = AutoEstimates()
    first = estimates.start(greedy=True)
    first["medusa"].tokens, first["medusa"].steps = 4.0, 30
    first["draft"].successes, first["draft"].trials, first["draft"].steps = 9.0, 10.0, 20
    estimates.finish(True, first)
    assert estimates.start(greedy=True)["medusa"].tokens == 4.0  # the first one is taken as it is
    second = estimates.start(greedy=True)
    second["medusa"].tokens = 1.8
    second["draft"].successes, second["draft"].trials = 2.0, 10.0
    estimates.finish(True, second)
    start = estimates.start(greedy=True)
    assert start["medusa"].tokens == pytest.approx(4.0 + CARRY_WEIGHT * (1.8 - 4.0))
    assert start["draft"].alpha == pytest.approx((9.0 + CARRY_WEIGHT * -7.0) / 10.0)
    assert 0.0 < CARRY_WEIGHT < 1.0


def test_short_requests_still_probe_an_option_that_looked_bad():
    """Requests of 3 steps each: the probe clock runs across requests, so an option whose
    early estimate was bad is tried again (a per-request clock never reached PROBE_EVERY)."""
    estimates = AutoEstimates()
    first = estimates.start(greedy=False)
    for _ in range(10):
        first["ngram"].update(drafted=4, accepted=0, emitted=1)  # looked useless once
    first["draft"].update(drafted=4, accepted=0, emitted=1)
    first["medusa"].update(drafted=3, accepted=0, emitted=1)
    estimates.finish(False, first)
    picks = []
    for _ in range(100):  # 100 requests of 3 steps
        chooser = Chooser(estimates.start(greedy=False), _costs(), estimates.clock(greedy=False))
        for _ in range(3):
            p = chooser.choose({"plain": 0, "ngram": 4})
            chooser.last_used[p] = chooser.step
            picks.append(p)
        estimates.finish(False, chooser.estimates)
    assert 3 <= picks.count("ngram") <= 30, picks.count("ngram")  # probed now and then, not chosen
    assert estimates.clock(greedy=False).step == 300 and estimates.clock(greedy=True).step == 0


def test_measured_step_times_correct_the_cost_model():
    """The model says an n-gram step costs 1.2 plain steps, but its steps really take 3x
    that (cache misses, bookkeeping): after a few measured steps auto stops choosing it,
    although its acceptance alone would make it look worth 2x."""
    from specops.spec.speculation import StepResult

    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    for _ in range(30):
        est["ngram"].update(drafted=4, accepted=2, emitted=3)
    costs = _costs()
    chooser = Chooser(est, costs)
    assert chooser.choose({"plain": 0, "ngram": 4}) == "ngram"  # on the model alone
    plain_s, ngram_s = costs.seconds("plain", 0), 3.0 * costs.seconds("ngram", 4)
    for _ in range(20):
        chooser.record("plain", StepResult(drafted=0, accepted=0, emitted=[1], raw_accepted=0), plain_s, 0)
        chooser.record("ngram", StepResult(drafted=4, accepted=2, emitted=[1, 2, 3], raw_accepted=2), ngram_s, 4)
    assert chooser.clock.scale["ngram"] == pytest.approx(3.0, rel=0.05)
    assert chooser.clock.scale["plain"] == pytest.approx(1.0)
    picks = [chooser.choose({"plain": 0, "ngram": 4}) for _ in range(10)]
    assert picks.count("plain") >= 9, picks
    chooser.record("ngram", StepResult(drafted=4, accepted=0, emitted=[1], raw_accepted=0), 1e6, 4)  # a preemption
    assert chooser.clock.scale["ngram"] <= 4.0


def test_a_lagging_draft_cache_is_a_switch_cost_spread_over_the_steps_left():
    """The draft model's catch-up (the tokens it has not read since its last step) is charged to
    the choice through `switch_s`, not to the draft's per-step cost: a draft that pays per step
    is taken when its catch-up is small against the steps left, and not when it is large."""
    est = {name: OptionEstimate() for name in ("plain", "ngram", "draft", "medusa")}
    for _ in range(30):
        est["draft"].update(drafted=4, accepted=3, emitted=4)
    chooser = Chooser(est, _costs())
    steady = chooser.rate("draft", 4)
    assert steady > chooser.rate("plain", 0)
    chooser.switch_s["draft"] = 0.05
    assert chooser.rate("draft", 4) == pytest.approx(steady * _costs().seconds("draft", 4) /
                                                     (_costs().seconds("draft", 4) + 0.05))
    assert chooser.choose({"plain": 0, "draft": 4}) == "draft"
    chooser.switch_s["draft"] = 50.0  # a long prefix to read for a few tokens' gain
    assert chooser.choose({"plain": 0, "draft": 4}) == "plain"


def test_the_draft_catch_up_is_measured_per_token_and_kept_across_requests(bundled):
    from specops.spec.auto import CATCHUP_WEIGHT, CatchUp

    catch = CatchUp(token_s=1.0)
    catch.observe(10, 2.0)  # 0.2 s per token
    assert catch.token_s == pytest.approx(1.0 + CATCHUP_WEIGHT * (0.2 - 1.0))
    catch.observe(0, 1.0)  # nothing read: no measurement
    catch.observe(5, 0.0)
    assert catch.token_s == pytest.approx(1.0 + CATCHUP_WEIGHT * (0.2 - 1.0))
    from specops.spec.auto import draft_token_s

    previous, bundled.auto_estimates = bundled.auto_estimates, AutoEstimates()  # every option untried: draft runs
    try:
        prompt = code_prompts(bundled, 1)[0]
        bundled.generate(prompt, method="auto", max_new_tokens=24)
        kept = bundled.auto_estimates.catchup(bundled.draft, 123.0)
        assert kept is bundled.auto_estimates.catchup(bundled.draft, 456.0)  # one per draft runner, across requests
        # it started at one draft token's seconds; the first draft step read the prompt and moved it
        assert kept.token_s > 0 and kept.token_s != draft_token_s(bundled.draft)
    finally:
        bundled.auto_estimates = previous


@pytest.fixture(scope="module")
def bundled_eagle(bundled):
    """The bundled decoder with a (random) EAGLE drafter bound to its target."""
    from specops.models.eagle_model import EagleDrafter

    drafter = EagleDrafter.for_target(bundled.target.model, seed=4).eval()
    return Decoder(bundled.target.model, draft=bundled.draft, medusa=bundled.medusa, eagle=drafter,
                   tokenizer=bundled.tokenizer)


def test_auto_with_an_eagle_drafter_is_exact_and_runs_it_between_the_others(bundled_eagle, monkeypatch):
    from specops.spec import auto
    from specops.spec.sampling import SamplingConfig, make_generator

    rng = random.Random(5)

    def mixed(self, available):  # every option in turn, so the drafter catches up after each of the others
        self.step += 1
        return rng.choice(sorted(available))

    monkeypatch.setattr(auto.Chooser, "choose", mixed)
    used: dict[str, int] = {}
    dec = bundled_eagle
    for i, prompt in enumerate(code_prompts(dec, 4) + [[7], [3, 9]]):
        ar = dec.generate(prompt, method="ar", max_new_tokens=30)
        # the Medusa heads stay an option beside the drafter (`Decoder.generate` leaves them out)
        tokens, stats = auto.generate_auto(dec.target, torch.tensor([prompt]), draft=dec.draft, heads=dec.medusa,
                                           sampling=SamplingConfig(), generator=make_generator(i), max_new_tokens=30,
                                           estimates=AutoEstimates(), eagle=dec.eagle, medusa_beside_eagle=True)
        assert tokens == ar.tokens, f"prompt {i}"
        for name, n in stats.auto_steps.items():
            used[name] = used.get(name, 0) + n
        out = dec.generate(prompt, method="auto", max_new_tokens=30)
        assert out.tokens == ar.tokens and "medusa" not in out.stats.auto_steps, f"prompt {i}"
    assert used.get("eagle", 0) > 10 and {"ngram", "draft", "medusa", "plain"} <= set(used), used


def _teacher_forced_prediction(target, drafter, tokens):
    """The drafter's prediction of the pending token's feature from every real entry, fed at once."""
    target.reset(1)
    with torch.inference_mode():
        features = target.forward(torch.tensor([tokens[:-1]]), need_hidden=True).hidden[0]
        cache = drafter.new_cache(len(tokens) + 8)
        return drafter.step(torch.tensor(tokens[1:]), features, cache)[-1]


def test_the_eagle_drafter_reads_the_features_of_steps_other_options_ran(bundled_eagle):
    """After plain, n-gram and its own steps, one catch-up leaves the drafter where a drafter fed
    the whole sequence's real features is; a step that commits without features puts it out of step."""
    from specops.spec.eagle import EagleProposer
    from specops.spec.ngram import NgramIndex, NgramProposer
    from specops.spec.sampling import SamplingConfig, make_generator
    from specops.spec.speculation import TargetVerifier
    from specops.spec.stats import DecodeStats
    from specops.spec.step import step

    target, drafter = bundled_eagle.target, bundled_eagle.eagle
    drafter.kernel_weights = "fp32"  # fed step by step against fed at once: fp32 rounding only
    prompt = code_prompts(bundled_eagle, 1)[0]
    with torch.inference_mode():
        v = TargetVerifier(target, prompt, sampling=SamplingConfig(), generator=make_generator(0), max_new_tokens=40,
                           eos_token_id=None, stats=DecodeStats(method="auto"), keep_features=True)
        v.prefill()
        eagle_p, ngram_p = EagleProposer(drafter, v.sampling, v.generator, target.vocab_size, v.device), \
            NgramProposer(NgramIndex(max_ngram=3))
        for p in (eagle_p, ngram_p):
            p.start(v)
        for option in ("plain", "ngram", "eagle", "plain", "plain", "ngram", "eagle", "ngram", "plain"):
            if option == "plain":
                result = v.verify([], None)
                ran = None
            else:
                ran = eagle_p if option == "eagle" else ngram_p
                result, _ = step(v, ran, 4)
            for p in (eagle_p, ngram_p):
                if p is not ran:
                    p.sync(v, result)
        assert eagle_p.cursor.waiting and eagle_p.catch_up(v)
        expected = _teacher_forced_prediction(target, drafter, v.tokens)
        torch.testing.assert_close(eagle_p.cursor.last, expected, atol=2e-4, rtol=1e-3)
        assert eagle_p.cursor.cache.length == len(v.tokens) - 1
        # a step committed without its features (as a one-call C step commits): the drafter stops drafting
        v.stats.target_forwards += 1
        result = v.commit([], int(torch.argmax(target.forward(torch.tensor([[v.tokens[-1]]])).logits[0, -1])),
                          drafted=0)
        eagle_p.sync(v, result)
        assert not eagle_p.cursor.in_step and not eagle_p.ready
