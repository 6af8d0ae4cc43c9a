"""``method="auto"``: pick the drafter per step from running estimates of what each one pays.

Every step of a request is one target verification on the same cache, whichever
drafter proposed it (`speculation.TargetVerifier` holds the sequence; the cache always
holds all of it but the pending token). The options are

* ``plain``  — nothing drafted: one single-token target forward (plain decoding);
* ``ngram``  — the prompt-lookup proposal (only when the context offers a match);
* ``draft``  — γ tokens from the draft model (it first feeds the tokens it has not seen);
* ``medusa`` — the Medusa heads' tree on the target's last hidden state (greedy one-call
  steps with `medusa_decode`'s prompt-lookup branch merged into it);
* ``eagle``  — γ tokens from the EAGLE drafter (`eagle.EagleProposer`). The verifier keeps the
  target's hidden states of every settled position, and the drafter keeps those of the steps
  other options ran and reads them in one forward when it next drafts.

With an EAGLE drafter in use the Medusa heads are left out (``medusa_beside_eagle`` keeps
them): both draft from the target's features, beside the drafter Medusa's steps lose their
one-call C loop (it returns no hidden states but the last, and the drafter reads every
step's), and a third drafter splits the probes of a short request further. On SmolLM2-135M's
mixed suite `auto` with both read below EAGLE alone and without the heads on par with it
(docs/benchmarks.md, real model).

For each option the request keeps an exponentially weighted mean of the tokens a step
emitted and of the seconds it took (measured here, so machine load, model size and
acceptance are all in it); each step runs the option with the most tokens per second.
The n-gram option keeps one acceptance per tier of its match's length (`NGRAM_TIERS`): a
step after a 16-token match copies far deeper than one after a 1-token match.
An option that looks worse is still tried now and then, the rarer the worse it looks
(so that its probes cost at most ``PROBE_BUDGET`` of the time; plain decoding, which has no
acceptance to learn, only every ``PROBE_MAX_WAIT`` steps), and the choice follows
the text as it changes; the estimates start from the decoder's running estimates of earlier
requests (greedy and sampling kept apart: acceptance differs) and are handed back at
the end. Past the deadline every step is ``plain``.

Lossless: each step verifies its proposal exactly (greedy argmax, or rejection
sampling with the drafter's own q), and which drafter proposes depends only on what
happened before the step, so the output is the target's greedy output, or distributed
as sampling the target alone. Because the choice depends on measured time, a seeded
sampled request is not reproducible token for token (its distribution is).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import weakref
from dataclasses import dataclass, field

import torch

from specops.spec.chooser import ChoiceClock, ProbeRule, choose
from specops.spec.clock import cost_clock, device_clock
from specops.spec.draft import CATCHUP_FREE, DraftModelProposer, check_vocab
from specops.spec.eagle import EagleProposer
from specops.spec.errors import InvalidRequestError
from specops.spec.medusa_branch import LOOKUP_BRANCH
from specops.spec.medusa_decode import MedusaProposer, MedusaState, c_steps
from specops.models.medusa_heads import HeadsLike
from specops.spec.ngram import NgramIndex, NgramProposer
from specops.spec.ngram_store import NgramStore
from specops.models.runner import ModelRunner, returns_layers
from specops.spec.sampling import SamplingConfig
from specops.spec.schedule import ConstantSchedule, GammaSchedule, expected_tokens
from specops.spec.request import prompt_list
from specops.spec.speculation import StepResult, TargetVerifier
from specops.spec.stats import DecodeStats
from specops.spec.step import Proposer, step
from specops.spec.tree_size import VerifyCostCurve, heads_overhead_s, plan_tree, verify_cost_curve

log = logging.getLogger(__name__)

OPTIONS = ("plain", "ngram", "draft", "medusa", "eagle")
NGRAM_TIERS = ((16, "ngram:16+"), (8, "ngram:8-15"), (3, "ngram:3-7"), (2, "ngram:2"), (1, "ngram:1"),
               (0, "ngram:store"))
"""The n-gram option's estimates, one per tier of its match's length (`ngram.match_gamma`'s tiers;
0: the corpus store's chain): how deep a match's continuation is accepted grows with how far back
the match goes (1.0 tokens after a 1-token match, 7.2 after 16 or more on the bundled code suite),
so one acceptance for every n-gram step read a long match, where n-gram copies whole runs, as
no better than the short ones around it, and `auto` drafted with another option there."""
ESTIMATES = OPTIONS + tuple(key for _, key in NGRAM_TIERS)


def ngram_tier(length: int) -> str:
    """The estimate an n-gram step after a match ``length`` tokens long reads (`NGRAM_TIERS`)."""
    return next((key for least, key in NGRAM_TIERS if length >= least), "ngram")
STEP_WEIGHT = 0.2  # weight of the newest step in a request's running acceptance
PROBE_EVERY = 24  # steps between tries of an option as good as the best; worse ones wait longer
PROBE_BUDGET = 0.005  # time probes of one worse option may cost, as a share of the best option's
PROBE_MAX_WAIT = 400  # no option waits longer than this many steps for its next try
STEP_RULE = ProbeRule(every=PROBE_EVERY, budget=PROBE_BUDGET, max_wait=PROBE_MAX_WAIT)
"""The probe rule of the per-step choice (`chooser.choose`); plain decoding, which has no acceptance
to learn, waits PROBE_MAX_WAIT steps (its tries only re-measure its cost scale)."""
HOPE = 2.0
"""How far above its running acceptance a linear drafter's probe wait reads it: by HOPE standard
errors (α + HOPE·sqrt(α(1-α)/n), n its running trials). The choice
of each step uses the running acceptance itself; only how soon a worse-looking option is tried
again uses this bound, so an estimate from few trials is re-measured soon and one from many is
left alone. With the plain running value, one unlucky early draft block on prose (acceptance
0.35 over ~4 trials, where the draft model runs at 0.8-0.97) made it look 2x worse than
Medusa, its next try waited ~230 steps, and `auto` ran Medusa request after request at 0.78x
the draft model's tokens/s. A drafter that keeps rejecting its first token has α near 0 and
so a bound near 0: it is still probed as rarely as before."""
SCALE_WEIGHT = 0.2  # weight of the newest step in an option's measured / modelled cost ratio
SCALE_BOUNDS = (0.25, 4.0)  # one step's ratio is clipped to these (a preemption is not a cost)
PRIOR_ALPHA, PRIOR_TRIALS = 0.5, 3.0  # acceptance before any measurement: worth 3 trials
PRIOR_TREE_TOKENS = 2.0  # tokens per Medusa step before any measurement
COST_REPEATS = 5  # timings of a draft token (the fastest is kept)
COST_CHAIN = 4  # tokens per timed C draft chain (the default γ), where the draft runner has one
CATCHUP_WEIGHT = 0.2  # weight of the newest catch-up in the running seconds per caught-up token
CARRY_WEIGHT = 0.3
"""Weight of a finished request's final estimates in those the next request starts from
(`AutoEstimates.finish`). With the last request's estimates carried over as they were, one
request's end decided where the next began: on the mixed suite, after a code request where
Medusa's steps emitted ~2 tokens, its estimate stood at 1.8 tokens per step, the probe rule put
its next try 220-400 steps away, and prose requests (where Medusa emits 4.3 per step) ran the
draft model. Alternated per prompt against that, four runs of the mixed suite (`ar`, the old
carry-over, this; 4 rounds each, 128 tokens): auto 1.43 -> 1.44x, 1.34 -> 1.48x, 1.45 -> 1.51x
and 1.48 -> 1.53x `ar`, code prompts 1.23-1.31 -> 1.31-1.44x."""


@dataclass
class OptionEstimate:
    """Running acceptance of one drafting option: of the drafted tokens tried (each up to
    the first rejection is a Bernoulli trial), the share accepted; for a tree, the mean
    tokens a step emitted."""

    successes: float = PRIOR_ALPHA * PRIOR_TRIALS
    trials: float = PRIOR_TRIALS
    tokens: float = PRIOR_TREE_TOKENS
    steps: int = 0

    @property
    def alpha(self) -> float:
        """Per-token acceptance of a linear block (the prior before any step)."""
        return self.successes / self.trials

    def update(self, drafted: int, accepted: int, emitted: int, weight: float = STEP_WEIGHT) -> None:
        trials = accepted + (1 if accepted < drafted else 0)
        self.successes = (1.0 - weight) * self.successes + accepted
        self.trials = (1.0 - weight) * self.trials + trials
        self.tokens += weight * (emitted - self.tokens)
        self.steps += 1


@dataclass
class ProbeClock(ChoiceClock):
    """The per-step choice's `ChoiceClock` (kept across requests) and each option's measured /
    modelled seconds (a running mean, see `Chooser.record`)."""

    scale: dict[str, float] = field(default_factory=lambda: {name: 1.0 for name in OPTIONS})


@dataclass
class CatchUp:
    """Running seconds per token of the draft model reading tokens it has not seen (the
    catch-up before its first step of a request, or after steps of other options)."""

    token_s: float

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.token_s += CATCHUP_WEIGHT * (seconds / tokens - self.token_s)


@dataclass
class AutoEstimates:
    """A decoder's running estimates per option, one set for greedy and one for sampling."""

    greedy: dict[str, OptionEstimate] = field(default_factory=dict)
    sampling: dict[str, OptionEstimate] = field(default_factory=dict)
    clocks: dict[bool, ProbeClock] = field(default_factory=dict)  # greedy? -> probe clock
    catchups: "weakref.WeakKeyDictionary[object, CatchUp]" = field(default_factory=weakref.WeakKeyDictionary)

    def catchup(self, draft: ModelRunner | None, draft_token_s: float) -> CatchUp:
        """The running catch-up cost of ``draft``, kept across requests; it starts at one draft
        token's seconds per token (a prefill reads tokens faster: the first measurement corrects it)."""
        if draft is None:
            return CatchUp(draft_token_s)
        found = self.catchups.get(draft)
        if found is None:
            found = self.catchups[draft] = CatchUp(draft_token_s)
        return found

    def start(self, greedy: bool) -> dict[str, OptionEstimate]:
        """A request's copy to work on."""
        table = self.greedy if greedy else self.sampling
        return {name: copy.copy(table.get(name, OptionEstimate())) for name in ESTIMATES}

    def clock(self, greedy: bool) -> ProbeClock:
        """The probe clock shared by the requests of one mode (greedy or sampling)."""
        return self.clocks.setdefault(greedy, ProbeClock())

    def finish(self, greedy: bool, request: dict[str, OptionEstimate]) -> None:
        """Fold a request's final estimates into the ones later requests start from: a running
        mean over requests (CARRY_WEIGHT for the newest), so one request's end does not set
        where the next one starts (see CARRY_WEIGHT)."""
        table = self.greedy if greedy else self.sampling
        for name, est in request.items():
            if not est.steps:
                continue
            kept = table.get(name)
            new = copy.copy(est)
            if kept is not None and kept.steps:
                new.successes = kept.successes + CARRY_WEIGHT * (est.successes - kept.successes)
                new.trials = kept.trials + CARRY_WEIGHT * (est.trials - kept.trials)
                new.tokens = kept.tokens + CARRY_WEIGHT * (est.tokens - kept.tokens)
            table[name] = new


@dataclass(frozen=True)
class Costs:
    """Seconds of each option's step, from the runners' measured costs (the fastest of
    several timings, so load on the machine does not bias one option against another)."""

    verify: VerifyCostCurve  # target forward over T new positions
    draft_token_s: float  # one draft-model token, drafted as decoding drafts (`draft_token_s`)
    heads_s: float  # one Medusa proposal
    tree_nodes: int  # N of the Medusa tree
    eagle_token_s: float = 0.0  # one EAGLE drafter forward (`eagle_token_s`)
    _memo: dict[tuple[str, int], float] = field(default_factory=dict, compare=False, repr=False)

    def seconds(self, option: str, drafted: int) -> float:
        key = (option, drafted)
        got = self._memo.get(key)
        if got is None:
            if option == "draft":
                got = self.verify.at(drafted + 1) + drafted * self.draft_token_s
            elif option == "eagle":  # γ - 1 chain forwards and the read of the step's accepted features
                got = self.verify.at(drafted + 1) + drafted * self.eagle_token_s
            elif option == "medusa":
                got = self.verify.at(self.tree_nodes) + self.heads_s
            else:
                got = self.verify.at(drafted + 1)  # plain (drafted 0), ngram
            self._memo[key] = got
        return got


class Chooser:
    """Picks the option of each step: expected tokens over modelled seconds, with probes."""

    def __init__(self, estimates: dict[str, OptionEstimate], costs: Costs, clock: ProbeClock | None = None) -> None:
        self.estimates = estimates
        self.costs = costs
        self.clock = clock if clock is not None else ProbeClock()
        self.counts = {name: 0 for name in OPTIONS}
        self.keys: dict[str, str] = {}
        """The estimate an option reads this step where not its own (n-gram: its match's tier, `ngram_tier`)."""
        # seconds an option's next step costs once on top of its steady step (the draft model
        # reading the tokens it has not seen), already spread over the steps it would pay off in
        self.switch_s: dict[str, float] = {}

    @property
    def step(self) -> int:
        return self.clock.step

    @step.setter
    def step(self, value: int) -> None:
        self.clock.step = value

    @property
    def last_used(self) -> dict[str, int]:
        return self.clock.last_used

    def rate(self, option: str, drafted: int, hopeful: bool = False) -> float:
        """Expected tokens per second of ``option`` drafting ``drafted`` tokens: the modelled
        seconds (isolated forwards, the fastest of several timings) times what this option's
        steps have really taken against that model (cache misses between forwards, the
        acceptance and bookkeeping around them, which grow with the drafted block), plus its
        `switch_s` (a lagging draft cache's catch-up, spread over the steps left). ``hopeful``:
        a linear drafter's acceptance read at its upper bound (`HOPE`), for probe waits."""
        est = self.estimates[self.keys.get(option, option)]
        if option == "plain":
            tokens = 1.0
        elif option == "medusa":
            tokens = est.tokens
        else:
            alpha = est.alpha
            if hopeful:
                n = max(est.trials, 1.0)
                alpha = min(1.0, alpha + HOPE * math.sqrt(max(alpha * (1.0 - alpha), 0.0) / n))
            tokens = expected_tokens(alpha, drafted)
        seconds = self.costs.seconds(option, drafted) * self.clock.scale[option] + self.switch_s.get(option, 0.0)
        return tokens / seconds

    def choose(self, available: dict[str, int]) -> str:  # option -> tokens it would draft
        """The option of this step (`chooser.choose` on modelled tokens per second)."""
        untried = [o for o in available if o != "plain" and not self.estimates[self.keys.get(o, o)].steps]
        return choose({o: self.rate(o, g) for o, g in available.items()}, self.clock, STEP_RULE, untried=untried,
                      hoped=lambda o: self.rate(o, available[o], hopeful=True), fixed_wait={"plain": PROBE_MAX_WAIT})

    def record(self, option: str, result: StepResult, seconds: float | None = None, drafted: int = 0) -> None:
        """Count a step; ``seconds``: what it took (planned to draft ``drafted`` tokens)."""
        if seconds is not None and seconds > 0:
            ratio = seconds / self.costs.seconds(option, drafted)
            ratio = min(max(ratio, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
            scale = self.clock.scale
            scale[option] += SCALE_WEIGHT * (ratio - scale[option])
        if option != "plain":
            self.estimates[self.keys.get(option, option)].update(result.drafted, result.raw_accepted,
                                                                 len(result.emitted))
        self.clock.used(option)
        self.counts[option] += 1


_DRAFT_COSTS: "weakref.WeakKeyDictionary[object, tuple[float, str]]" = weakref.WeakKeyDictionary()


def draft_token_s(draft: ModelRunner) -> float:
    """Seconds of one draft-model token (`draft_token_cost`)."""
    return draft_token_cost(draft)[0]


def draft_token_cost(draft: ModelRunner) -> tuple[float, str]:
    """Seconds of one draft-model token after a short prefix (fastest of COST_REPEATS), drafted
    the way `draft._draft_block` drafts, and how: "C chain" (per token of a chain of
    COST_CHAIN tokens in one call, where the runner has one: `FastLlamaRunner.draft_chain`,
    fp32 CPU) or "forward" (one `forward` and argmax). Measured once per runner; leaves the
    draft's cache empty."""
    cached = _DRAFT_COSTS.get(draft)
    if cached is None:
        draft.reset(1)
        draft.forward(torch.zeros(1, 16, dtype=torch.long, device=draft.device))  # [1, 16]
        chain = getattr(draft, "draft_chain", None)
        if chain is not None and chain([0], COST_CHAIN) is None:
            chain = None  # this runner loops (`forward`) for these tokens
        draft.truncate(16)
        ids = torch.zeros(1, 1, dtype=torch.long, device=draft.device)  # [1, 1]
        samples = []
        clock = cost_clock(draft.device)
        for _ in range(COST_REPEATS + 1):
            t0 = clock()
            if chain is not None:
                chain([0], COST_CHAIN)
                samples.append((clock() - t0) / COST_CHAIN)
            else:
                int(torch.argmax(draft.forward(ids).logits[0, -1]))
                samples.append(clock() - t0)
            draft.truncate(16)
        draft.reset(1)
        cached = _DRAFT_COSTS[draft] = (min(samples[1:]), "forward" if chain is None else "C chain")
    return cached


_EAGLE_COSTS: "weakref.WeakKeyDictionary[object, float]" = weakref.WeakKeyDictionary()


def eagle_token_s(drafter) -> float:
    """Seconds of one EAGLE drafter forward of one entry after a short prefix, with its LM head
    (fastest of COST_REPEATS): a drafted token, or the read of a step's accepted features.
    Measured once per drafter, on a cache of its own."""
    from specops.spec.eagle import torch_single_thread

    cached = _EAGLE_COSTS.get(drafter)
    if cached is None:
        device = drafter.fc.weight.device
        width = drafter.fc.weight.shape[1] - drafter.config.hidden_size  # features per entry (E, or k*E)
        cache = drafter.new_cache(32)
        tokens = torch.zeros(16, dtype=torch.long, device=device)
        features = torch.zeros(16, width, dtype=drafter.fc.weight.dtype, device=device)
        clock = cost_clock(device)
        samples = []
        with torch.inference_mode(), torch_single_thread() if device.type == "cpu" else contextlib.nullcontext():
            drafter.step(tokens, features, cache)
            for _ in range(COST_REPEATS + 1):
                t0 = clock()
                out = drafter.step(tokens[:1], features[:1], cache)
                int(torch.argmax(drafter.logits(out[-1])))
                samples.append(clock() - t0)
                cache.truncate(16)
        cached = _EAGLE_COSTS[drafter] = min(samples[1:])
    return cached


def generate_auto(
    target: ModelRunner,
    prompt_ids: torch.Tensor,  # [B, T] long, B == 1
    *,
    draft: ModelRunner | None,
    heads: HeadsLike | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_new_tokens: int,
    estimates: AutoEstimates,
    eos_token_id: int | list[int] | None = None,
    schedule: GammaSchedule | None = None,
    deadline_s: float | None = None,
    max_ngram: int = 3,
    min_ngram: int = 1,
    store: NgramStore | None = None,
    eagle=None,
    medusa_beside_eagle: bool = False,
) -> tuple[list[int], DecodeStats]:
    """Decode with the per-step choice of drafter; returns ``(tokens, DecodeStats)``.

    ``draft`` / ``heads`` / ``eagle`` (an EAGLE drafter bound to the target): the components
    available (None: that option is off; an EAGLE-3 drafter whose layers the target runner does
    not return is left out). γ for the draft model, the EAGLE drafter and the n-gram lookup comes
    from ``schedule`` (default 4; it learns from the draft model's steps); the Medusa tree is
    `tree_size.plan_tree`'s. ``stats.auto_steps`` counts the steps per option.
    ``medusa_beside_eagle``: keep ``heads`` as an option beside an EAGLE drafter in use (default:
    leave them out, see the module docstring).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if draft is not None:
        check_vocab(target, draft)
    schedule = schedule if schedule is not None else ConstantSchedule(4)
    prompt = prompt_list(prompt_ids)
    stats = DecodeStats(method="auto")
    stats.start()
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram, store=store)
    if eagle is not None and eagle.feature_layers is not None and not returns_layers(target):
        log.info("auto leaves the EAGLE-3 drafter out: %s does not return the hidden layers it reads",
                 type(target).__name__)
        eagle = None
    if eagle is not None and heads is not None and not medusa_beside_eagle:
        log.debug("auto leaves the Medusa heads out beside the EAGLE drafter (medusa_beside_eagle keeps them)")
        heads = None
    medusa = None
    heads_s = 0.0
    if heads is not None:
        medusa = MedusaState(target, heads, plan_tree(target, heads, heads.num_heads), heads.num_heads)
        heads_s = heads_overhead_s(heads, target, heads.num_heads)
        stats.heads = heads.num_heads
    costs = Costs(verify=verify_cost_curve(target), draft_token_s=0.0 if draft is None else draft_token_s(draft),
                  heads_s=heads_s, tree_nodes=1 if medusa is None else medusa.spec.num_nodes,
                  eagle_token_s=0.0 if eagle is None else eagle_token_s(eagle))
    v = TargetVerifier(
        target,
        prompt,
        sampling=sampling,
        generator=generator,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        stats=stats,
        deadline_s=deadline_s,
        keep_hidden=medusa is not None,
        keep_features=False if eagle is None else (True if eagle.feature_layers is None else eagle.feature_layers),
    )
    v.prefill()
    request = estimates.start(sampling.greedy)
    chooser = Chooser(request, costs, estimates.clock(sampling.greedy))
    catchup = estimates.catchup(draft, costs.draft_token_s)
    # the linear drafters run `step.step`, the same step as their own methods; every one of them
    # reads every verified step, whichever proposed it
    ngram = NgramProposer(index)
    # the draft reads the prompt at its first step, so a request that never drafts never pays its prefill
    drafter = None if draft is None else DraftModelProposer(draft, sampling, generator, prefill=False,
                                                            on_catch_up=catchup.observe)
    proposers: dict[str, Proposer] = {"ngram": ngram} if drafter is None else {"ngram": ngram, "draft": drafter}
    heads_p = None
    if medusa is not None:
        # greedy Medusa steps in one C call where the runner has them (`FastLlamaRunner.medusa_loop`); the
        # prompt-lookup branch reads the n-gram proposer's index
        # (not beside an EAGLE drafter, which reads every step's hidden states: the C loop keeps the last only)
        medusa_c = c_steps(target, heads, medusa.num_heads, medusa.spec, None, LOOKUP_BRANCH) \
            if sampling.greedy and eagle is None else None
        heads_p = proposers["medusa"] = MedusaProposer(medusa, sampling, steps=medusa_c, index=index)
    eagle_p = None
    if eagle is not None:
        eagle_p = proposers["eagle"] = EagleProposer(eagle, sampling, generator, target.vocab_size, v.device)
    for proposer in proposers.values():
        proposer.start(v)

    while not v.done:
        stats.gamma = schedule.next_gamma()
        room = v.max_draft()
        gamma = min(stats.gamma, room)
        proposal = ngram.peek(gamma, room)
        available = {"plain": 0}  # option -> tokens it would draft
        if proposal:
            available["ngram"] = len(proposal)
            chooser.keys["ngram"] = ngram_tier(index.last_match)
        draft_gamma = 0 if drafter is None else min(gamma, drafter.room(v))
        if draft_gamma:
            available["draft"] = draft_gamma
            lag = len(v.tokens) - draft.cache_len - CATCHUP_FREE  # tokens the draft must read first
            steps_left = max(1.0, v.remaining / expected_tokens(request["draft"].alpha, draft_gamma))
            chooser.switch_s["draft"] = max(lag, 0) * catchup.token_s / steps_left
        if medusa is not None and room and v.has_hidden:
            available["medusa"] = min(room, medusa.spec.depth)
        eagle_gamma = 0 if eagle_p is None or not eagle_p.ready else min(gamma, eagle_p.room(v))
        if eagle_gamma:
            available["eagle"] = eagle_gamma
        option = chooser.choose(available) if len(available) > 1 else "plain"
        t_step = device_clock(v.device)
        if option in proposers:
            # a Medusa tree is cut to the budget only (its branch may reach past the heads' depth)
            result, cost = step(v, proposers[option], room if option == "medusa" else available[option])
            if option == "draft":  # γ schedules model a draft model's cost
                t_step += drafter.caught_up  # the catch-up is charged through switch_s, not the step's cost scale
                schedule.update(cost.drafted, result.raw_accepted, cost.draft_s, cost.verify_s)
            elif option == "medusa":  # the heads ran again after another option: a switch, not the step's cost
                t_step += heads_p.caught_up
        else:
            result = v.verify([], None)
        for name, proposer in proposers.items():
            if name != option:
                proposer.sync(v, result)
        chooser.record(option, result, device_clock(v.device) - t_step, available.get(option, 0))

    estimates.finish(sampling.greedy, request)
    stats.auto_steps = {name: n for name, n in chooser.counts.items() if n}
    if medusa is not None:
        stats.head_predictions, stats.head_correct = medusa.head_accuracy(v.output)
    stats.finish(v.stop_reason())
    return v.output, stats
