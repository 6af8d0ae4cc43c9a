"""The synchronous serving engine: continuous batching with ragged speculation over a paged cache.

```python
eng = Engine(Decoder.from_pretrained("bundled"), max_batch=16, kv_cache_mb=64)
eng.add("r1", prompt_ids, SamplingParams(max_tokens=64), SpecSettings(method="draft", gamma=4))
while eng.has_unfinished():
    for out in eng.step():          # StepOutput(request_id, new_token_ids, finished, finish_reason, record)
        ...
```

One `step`: schedule (`scheduler`: running first, admit waiting, preempt the newest
when blocks run out) → plan (`plan_schedule` says whether this step plans at all — veto,
plain probe, quiet stretch, probe; `spec_planner`: each sequence's γ or tree size, 0 when it
does not pay, from its acceptance estimate and the measured costs: verify forwards per
(B, T), draft-model rounds per batch width, each method's per-sequence proposal and
verification overhead, the step's fixed host time) → grant lookahead blocks → propose
(n-gram lookup, one batched draft-model pass, an EAGLE drafter chain per sequence or a greedy
request's EAGLE-2 dynamic tree (`eagle_proposer`), or Medusa heads on the batch's hidden
states, a greedy request's prompt-lookup branch merged into its tree:
`specops.spec.medusa_branch`) → ONE target forward over every sequence's new tokens
(prefills, plain steps, linear drafts and trees side by side; `batch_forward`) → verify each
sequence with `specops.spec.verify` / `tree_verify` (greedy, or lossless rejection sampling
with the request's own seeded generator; a sampled Medusa request whose settings ask for it,
`SpecSettings.typical`, takes LOSSY typical acceptance instead) → commit, roll both caches
back to the accepted prefix (or compact the accepted tree path) and give surplus blocks back.
Two collaborators hold their own parts of it: `tree_plans.TreePlans` (``Engine.trees``) offers
the plan Medusa trees with their prompt-lookup branches and EAGLE-2 trees, settles what a chosen
tree proposes and calibrates the estimates on every verified tree; `step_accounts.StepAccounts`
(``Engine.accounts``) meters the step's times the planner charges (per-method overhead, fixed
host time), counts plain and speculative decode steps and keeps the speed-up estimate.

Requests join and leave between steps. Not thread-safe: one thread calls add / abort /
step (`specops.engine.async_engine` runs it on its own thread). `step` returns one
`StepOutput` per request that committed tokens or finished; tokens are never retracted.
``finish_reason`` is "stop" (EOS, kept in the output), "length" (``max_tokens`` or
``max_model_len``) or "abort" (one final output with no tokens, at the step after
`abort`); a finished output carries the request's `DecodeStats` as ``record`` (method
that ran, drafted, accepted, fallback_reason, per-head Medusa accuracy, timings;
``record.to_record(request_class)`` is the telemetry `DecodeRecord`).
`SpecSettings.gamma` / ``tree_size`` are upper bounds: the planner picks 0..bound per
step. A missing component (no draft model / no Medusa heads / no EAGLE drafter) makes
`add` raise ValueError, except a draft that `Decoder(fallback=True)` dropped, which runs plain
decoding with ``fallback_reason == "draft_unavailable"``. Llama / Mistral / Qwen2 targets and drafts run batched on the paged cache; other
transformers models (GPT-2, ...) run through the generic path, one forward per
sequence (slower, same results). Greedy output equals ``Decoder.generate(method="ar")``
token for token up to float rounding of the batched matmuls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from specops.spec.auto import STEP_RULE, ngram_tier
from specops.spec.clock import cost_clock
from specops.spec.medusa_branch import context_index
from specops.spec.medusa_decode import head_accuracy
from specops.spec.ngram import NgramIndex
from specops.spec.request import eos_set
from specops.spec.sampling import make_generator
from specops.spec.stats import DecodeStats
from specops.spec.speculation import DRAFT_CONTEXT, draft_room, judge_block, step_tokens
from specops.spec.tree_verify import TypicalAcceptance, judge_tree
from specops.spec.verify import accept_greedy
from specops.kernels import cpu_linear
from specops.engine.acceptance import (ALPHA_PRIOR, ALPHA_RECOVERY, EAGLE_TREE, SEQ_DECAY, SEQ_PRIOR_TRIALS,
                                       AcceptancePriors)
from specops.engine.calibration import calibrate as calibrate_costs
from specops.engine.plan_limits import FULL_CATCH_UP, PLAN_PREFILL_LIMIT
from specops.engine.plan_schedule import PlanSchedule
from specops.engine.auto_method import MethodChooser, Profile, StepChoice, rate
from specops.engine.batch_forward import FeedItem, bytes_per_token, make_backend
from specops.engine.kv_pool import BlockPool
from specops.engine.kv_budget import available_memory_bytes, choose_kv_budget
from specops.engine.eagle_proposer import EagleProposer
from specops.engine.proposers import (DraftGroup, EagleGroup, GroupProposer, MedusaGroup, MedusaProposer, NgramGroup)
from specops.engine.scheduler import Scheduler
from specops.engine.sequence import (
    EngineStats,
    PromptTooLongError,
    SamplingParams,
    Sequence,
    SpecSettings,
    StepOutput,
)
from specops.engine.spec_planner import DEFAULT_MARGIN, Candidate, CostModel, SpecCalibration, plan
from specops.engine.step_accounts import StepAccounts, overhead_kind
from specops.engine.tree_plans import TreePlans

log = logging.getLogger(__name__)

TYPICAL = TypicalAcceptance()  # the rule of sampled Medusa requests that ask for typical acceptance (lossy)


class Engine:
    """Continuous batching over a `Decoder`'s target (and draft model / Medusa heads / EAGLE drafter)."""

    def __init__(self, decoder: Any, *, max_batch: int = 16, kv_cache_mb: float | None = 64.0, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic, eos_token_id: Any = "model",
                 max_step_tokens: int = 4096, calibrate: bool = True, prefix_caching: bool = True) -> None:
        """``kv_cache_mb``: the whole KV budget (target and draft caches together), split so both
        hold the same number of token slots; None: `kv_budget.auto_kv_cache_mb` (``max_batch`` sequences at
        the target's full context, twice over, within a share of the memory available now; logged). ``eos_token_id``: "model" takes the target
        config's; None never stops early. ``calibrate``: time a few batched forwards now to
        seed the verify-cost model (it keeps learning from real steps either way).
        ``prefix_caching``: reuse the target KV of full prompt blocks seen before (paged path)."""
        for name, value in (("max_batch", max_batch), ("block_size", block_size), ("max_step_tokens", max_step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        runner, draft = decoder.target, decoder.draft
        per_slot = bytes_per_token(runner) + (bytes_per_token(draft) if draft is not None else 0)
        if kv_cache_mb is not None and (
                isinstance(kv_cache_mb, bool) or not isinstance(kv_cache_mb, (int, float)) or not kv_cache_mb > 0):
            raise ValueError(f"kv_cache_mb must be > 0, got {kv_cache_mb!r}")
        self.kv_budget = choose_kv_budget(kv_cache_mb, per_slot, max_batch, runner.max_context,
                                          None if kv_cache_mb is not None else available_memory_bytes(runner.device))
        kv_cache_mb = self.kv_budget.mb
        self.decoder = decoder
        self.clock = clock
        self.max_batch = max_batch
        num_blocks = int(kv_cache_mb * 2**20) // (per_slot * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_mb={kv_cache_mb} holds no block of {block_size} tokens ({per_slot} B/token)")
        paged = hasattr(runner, "layers") and hasattr(runner, "lm_head")  # prefix sharing needs the paged path
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=prefix_caching and paged)
        self.target = make_backend(runner, self.pool)
        self.draft_pool = BlockPool(num_blocks, block_size) if draft is not None else None
        self.draft = make_backend(draft, self.draft_pool) if draft is not None else None
        self.kv_bytes = num_blocks * block_size * per_slot
        log.info("%s", self.kv_budget.describe(num_blocks, block_size))
        self.max_model_len = min(runner.max_context, self.pool.capacity_slots)
        self.vocab_size = runner.vocab_size
        self.device = runner.device
        self.medusa = MedusaProposer(decoder.medusa, runner.device) if decoder.medusa is not None else None
        eagle = getattr(decoder, "eagle", None)
        self.eagle = EagleProposer(eagle, runner.device, self.pool) if eagle is not None else None
        self.ngram_store = getattr(decoder, "ngram_store", None)  # the n-gram drafter's corpus fallback
        if eos_token_id == "model":
            eos_token_id = getattr(getattr(getattr(runner, "model", None), "config", None), "eos_token_id", None)
        self.eos = eos_set(eos_token_id)
        self.scheduler = Scheduler(self.pool, max_batch=max_batch, max_step_tokens=max_step_tokens,
                                   draft_pool=self.draft_pool, release=self._release,
                                   features=self.eagle.has_features if self.eagle is not None and self.eagle.pool is not None else None)
        self.cost_clock = cost_clock(self.device)
        self.cost = CostModel(warmup=1)  # target forwards (verify)
        self.draft_cost = CostModel(warmup=1)  # draft-model forwards (one drafting round)
        # each method's drafter side of the step, behind one interface (`proposers.GroupProposer`)
        self.proposers: dict[str, GroupProposer] = {"ngram": NgramGroup()}
        if self.draft is not None:
            # the engine's accounts looked up per call (a test or a subclass may swap them)
            self.proposers["draft"] = DraftGroup(self.draft, self.cost_clock, lambda forwards: self._observe_draft(forwards),
                                                 lambda *args: self._note_catch_up(*args))
        if self.eagle is not None:
            self.proposers["eagle"] = EagleGroup(self.eagle, self.cost_clock)
        if self.medusa is not None:
            self.proposers["medusa"] = MedusaGroup(self.medusa, self.cost_clock)
        # overhead meters, fixed host time, proposal seconds, decode-step counts, speed-up estimate
        self.accounts = StepAccounts(lambda: self.cost)  # the engine's verify cost looked up per call
        self.margin = DEFAULT_MARGIN
        self.schedule = PlanSchedule()  # veto, plain probes, quiet stretches, probes (`plan_schedule`)
        # the plan's misses, per batch size, from the steps' record; None: plans as the models predict, no
        # veto (tests that give the engine a synthetic cost model, which real step times cannot calibrate)
        self.calibration: SpecCalibration | None = SpecCalibration()
        self._step_pred: tuple[float, float] | None = None  # this step's plan: (predicted s, plain predicted s)
        # this step's one-time draft-cache catch-up beyond FULL_CATCH_UP tokens (planner clock, wall)
        self._catch_up = (0.0, 0.0)
        self.seqs: dict[str, Sequence] = {}
        self.auto: dict[tuple[str | None, bool], MethodChooser] = {}  # method="auto": per (auto_key, sampled)
        self.priors = AcceptancePriors()
        # Medusa trees and their prompt-lookup branches, EAGLE-2 trees: offers, settled plans, calibration
        self.trees = TreePlans(self.priors, self.medusa, self.max_model_len,
                               lambda request_id, seconds: self.accounts.note_lookup(request_id, seconds))
        self._last_batch = 0
        if calibrate:
            calibrate_costs(self)

    # -- requests ------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, spec: SpecSettings) -> None:
        """Queue a request; raises `PromptTooLongError` or ValueError (naming the field) on bad input."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already running")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt_ids is empty: give at least one token id")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is not an int in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens leaves no room for output: max_model_len is {self.max_model_len}")
        sampling = params.config()
        spec.check()
        auto = spec.method == "auto"
        if auto:  # lossless: typical acceptance is a Medusa request's own choice
            spec = replace(spec, method=self._chooser(spec.auto_key, params.temperature > 0).choose(
                self.speculative_methods), typical=False)
        chain_auto = auto and spec.method in ("draft", "eagle")  # weighs lookup each step (unless an EAGLE-2 tree)
        fallback = None
        if spec.method == "draft" and self.draft is None and getattr(self.decoder, "draft_error", None):
            # Decoder(fallback=True) dropped an unusable draft: plain decoding, as Decoder.generate does
            spec, fallback = SpecSettings(method="ar", deadline_s=spec.deadline_s), "draft_unavailable"
        if spec.method == "draft" and self.draft is None:
            raise ValueError("method 'draft' needs a draft model and this engine's decoder has none")
        if spec.method == "eagle" and self.eagle is None:
            raise ValueError("method 'eagle' needs an EAGLE drafter and this engine's decoder has none "
                             "(`specops serve --eagle PATH`, Decoder(target, eagle=...))")
        heads = 0
        if spec.method == "medusa":
            if self.medusa is None:
                raise ValueError("method 'medusa' needs Medusa heads and this engine's decoder has none")
            total = self.medusa.heads.num_heads
            heads = total if spec.medusa_heads is None else spec.medusa_heads
            if heads > total:
                raise ValueError(f"medusa_heads must be in 1..{total} (the heads loaded), got {heads}")
        # γ / tree size are bounds the planner works under each step (`DecodeRecord.planned`)
        stats = DecodeStats(method=spec.method, heads=heads, fallback_reason=fallback,
                            planned=spec.method in ("draft", "ngram", "medusa", "eagle"))
        stats.start()
        now = self.clock()
        seq = Sequence(
            request_id=request_id, tokens=ids, prompt_len=len(ids), params=params, spec=spec, sampling=sampling,
            generator=make_generator(params.seed, self.device), arrival=now,
            budget=min(params.max_tokens, self.max_model_len - len(ids)), stats=stats,
            deadline_at=None if spec.deadline_s is None else now + spec.deadline_s,
            heads=heads,
        )
        seq.prior_key = (spec.auto_key, spec.method, params.temperature > 0)
        seq.alpha = self.priors.alpha(seq.prior_key, spec.method)
        seq.accept_scale = self.priors.scale(seq.prior_key)
        if spec.method == "ngram" or chain_auto:
            seq.ngram = NgramIndex(store=self.ngram_store if params.temperature == 0 else None)  # greedy only:
            # see `specops.decoder.api._corpus`
            seq.ngram.extend(ids)
        if spec.method == "medusa" and sampling.greedy and self.trees.lookup_branch(seq):
            seq.ngram = context_index(ids)  # the prompt-lookup branch's index
        if spec.method == "eagle":
            seq.eagle = self.eagle.start(seq)
            if seq.eagle.shape is not None:
                seq.accept_scale = self.priors.tree_scale(self.trees.tree_key(seq))
        if chain_auto and (seq.eagle is None or seq.eagle.shape is None):
            # auto on a chain drafter: lookup is weighed too, each step (`StepChoice`), per tier of its match
            auto_key, sampled = spec.auto_key, params.temperature > 0

            def lookup(tier: str) -> Profile:
                key = (auto_key, tier, sampled)
                return Profile(self.priors.alpha(key, "ngram"), 0.0, 0.0, self.priors.scale(key), key)

            seq.auto_step = StepChoice(seq, spec.method, lookup, STEP_RULE)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    @property
    def speculative_methods(self) -> tuple[str, ...]:
        """The speculative methods this engine can run (n-gram always; draft / Medusa / EAGLE when loaded)."""
        return (("ngram",) + (("draft",) if self.draft is not None else ()) + (("medusa",) if self.medusa is not None else ())
                + (("eagle",) if self.eagle is not None else ()))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed and a final "abort" output comes at the next step."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.aborted = True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def _chooser(self, key: str | None, sampled: bool) -> MethodChooser:
        """The auto chooser of one (class, greedy/sampled) pair: what pays differs between them."""
        chooser = self.auto.get((key, sampled))
        if chooser is None:
            chooser = self.auto[(key, sampled)] = MethodChooser()
        return chooser

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running), batch_size=self._last_batch,
            kv_blocks_used=self.pool.num_used, kv_blocks_free=self.pool.num_free,
            kv_blocks_total=self.pool.num_blocks, preemptions=self.scheduler.preemptions,
            prefix_cache_hit_blocks=self.pool.cache_hits, prefix_deferrals=self.scheduler.deferrals,
            plain_steps=self.accounts.decode_steps[0], spec_steps=self.accounts.decode_steps[1],
            vetoes=self.schedule.vetoes, probes=self.schedule.probes,
            plain_probes=self.schedule.plain_probes, medusa_branches=self.trees.medusa_branches,
            medusa_branch_tokens=self.trees.medusa_branch_tokens,
            attention_kernel="cpu-paged" if getattr(getattr(self.target, "model", None), "cpu_kernel", False) else "sdpa")

    def _release(self, seq: Sequence) -> None:
        self.target.release(seq.target)
        if self.draft is not None:
            self.draft.release(seq.draft)
        if self.eagle is not None:
            self.eagle.release(seq)

    # -- one step ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batched target forward (plus proposals) and return what it committed."""
        outputs: list[StepOutput] = []
        for seq in [s for s in self.seqs.values() if s.aborted]:
            outputs.append(self._finish(seq, "abort"))
        t_step, w_step = self.cost_clock(), time.perf_counter()
        batch = self.scheduler.schedule()
        self._last_batch = len(batch)
        if not batch:
            return outputs
        self.accounts.start_step()
        self._catch_up = (0.0, 0.0)
        self._step_pred = None
        w_plan = time.perf_counter()
        plans = self._plan(batch)
        plan_wall = time.perf_counter() - w_plan  # proposals and draft rounds: speculation's (`speedup_estimate`)
        items, need_hidden = [], False
        for seq in batch:
            item, hidden = self._feed(seq, plans.get(seq.request_id))
            items.append(item)
            need_hidden |= hidden
        t0, c0 = time.perf_counter(), self.cost_clock()
        outs = self.target.forward(items, need_hidden=need_hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if self.eagle is not None:  # keep eagle sequences' hidden rows; verification reads its own rows
            outs = [out if seq.eagle is None else
                    self.eagle.observe(seq, it, out, len(plans.get(seq.request_id, {}).get("drafts", ())),
                                       tree="tree_tokens" in plans.get(seq.request_id, {}))
                    for seq, it, out in zip(batch, items, outs)]
        forward_cost = self.cost_clock() - c0
        total = sum(len(it.tokens) for it in items)
        prefilling = [seq.target.computed - len(it.tokens) < len(seq.tokens) - 1 for seq, it in zip(batch, items)]
        if self.schedule.probing:
            self.schedule.after_probe(self.cost.predict(len(items), total), forward_cost)
        # the plain prediction before this step counts
        plain_pred = (self.accounts.fixed_s(len(items)) + self.cost.predict(len(items), total)
                      if self.calibration is not None and self._step_pred is None else 0.0)
        if not any(prefilling):
            self.cost.observe(len(items), total, forward_cost)  # decode / verify steps only: what the planner predicts
        greedy = self._verify_greedy_batch(batch, plans, outs)
        plain_commit: list[float] = []
        spec_commit: list[tuple[Sequence, float]] = []
        emitted: list[tuple[Sequence, int]] = []  # decoding sequences and the tokens each emitted now
        verified = 0  # draft / tree tokens the forward verified beyond one per speculating sequence
        t1 = self.cost_clock()  # one reading per commit, each ending the previous interval (on CPU the
        for seq, item, out, pre in zip(batch, items, outs, prefilling):  # clock is a ~5 us syscall on some VMs)
            p = plans.get(seq.request_id)
            speculated = p is not None and (bool(p.get("drafts")) or "tree_tokens" in p)
            before = seq.stats.new_tokens
            result = self._commit(seq, item, out, p, dt * len(item.tokens) / total, greedy.get(seq.request_id))
            t2 = self.cost_clock()
            spent, t1 = t2 - t1, t2
            if speculated:
                spec_commit.append((seq, spent))
                verified += len(item.tokens) - 1
            elif len(item.tokens) == 1:
                plain_commit.append(spent)
            if not pre:
                emitted.append((seq, seq.stats.new_tokens - before))
            if result is not None:
                outputs.append(result)
        if self.calibration is not None and not any(prefilling):
            # the veto's realized rates, only kept while it is on
            tokens, wall = ((sum(n for _, n in emitted), time.perf_counter() - w_step) if self.schedule.veto_steps
                            else (0, 0.0))
            if spec_commit and self._step_pred is not None:
                # both judge speculation's recurring cost: a long draft-cache catch-up is paid once per
                # request (the plan charges it spread over its steps: `_candidate`), see `_note_catch_up`
                catch_cost, catch_wall = self._catch_up
                self.calibration.observe_spec(len(batch), t1 - t_step - catch_cost, *self._step_pred, tokens=tokens,
                                              wall_s=max(wall - catch_wall, 0.0) if wall else 0.0)
                self.schedule.judge(len(batch), self.calibration.losing)
            elif not spec_commit:
                self.calibration.observe_plain(len(batch), t1 - t_step, plain_pred, tokens=tokens, wall_s=wall)
        self.accounts.measure_overheads(len(batch), t1 - t_step - forward_cost, plain_commit, spec_commit)
        self.accounts.count_plain_time(len(batch), time.perf_counter() - w_step, emitted, bool(spec_commit),
                                       any(prefilling), spec_s=plan_wall + dt * verified / total)
        if emitted:
            self.accounts.count_step(bool(spec_commit))
        return outputs

    def _verify_greedy_batch(self, batch: list[Sequence], plans: dict[str, dict], outs) -> dict[str, tuple[int, int]]:
        """(accepted, next token) of every greedy linear sequence, from ONE argmax over all their
        logit rows: drafts are accepted while they equal the target's argmax, then its argmax
        follows (`verify_greedy`'s rule). The comparison runs on the few ints in Python (a tensor
        form would cost several tensor ops per step, more than the argmax). When every output is
        rows of the step's one logits tensor (the paged backend) the argmax runs over that tensor
        as it is, rather than over a concatenation of every sequence's rows."""
        seqs, rows = [], []
        for seq, out in zip(batch, outs):
            p = plans.get(seq.request_id)
            if seq.sampling.greedy and (p is None or "tree_tokens" not in p):
                seqs.append((seq, [] if p is None else p["drafts"]))
                rows.append(out)
        if not seqs:
            return {}
        whole = outs[0].step_logits
        result: dict[str, tuple[int, int]] = {}
        if whole is not None and all(out.step_logits is whole for out in rows):
            choice = cpu_linear.argmax(whole).tolist()  # [R] every row of the step
            for (seq, drafts), out in zip(seqs, rows):
                result[seq.request_id] = accept_greedy(drafts, choice, out.row0)
            return result
        flat = rows[0].logits if len(rows) == 1 else torch.cat([out.logits for out in rows])  # [R, V]
        choice = cpu_linear.argmax(flat).tolist()  # [R]
        r0 = 0
        for (seq, drafts), out in zip(seqs, rows):
            result[seq.request_id] = accept_greedy(drafts, choice, r0)
            r0 += out.logits.shape[0]
        return result

    def _plan(self, batch: list[Sequence]) -> dict[str, dict]:
        """Choose every decoding sequence's speculation, grant its blocks, and propose."""
        cands, owners = [], []
        self.accounts.start_plan()
        self.trees.start_plan()
        if sum(len(seq.tokens) - 1 - seq.target.computed for seq in batch) > PLAN_PREFILL_LIMIT:
            # a long prefill shares this forward: its cost is outside the measured (B, T) curves (they are
            # fitted on decode / verify steps), so the planner's marginal verify cost here is a guess
            # (extrapolated, it made drafts look free beside a prompt); the step decodes plainly
            return {}
        b = len(batch)
        observed = any(seq.spec.observed for seq in batch)
        vetoed = self.schedule.vetoed(b, self.calibration)
        if vetoed and not observed:  # speculating here made decoding slower (`PlanSchedule`)
            return {}
        if self.schedule.skip(b, observed):  # a plain probe, or a quiet stretch after a decline
            return {}
        now = self.clock()
        base = sum(len(s.tokens) - s.target.computed for s in batch)
        for seq in batch:
            if seq.spec.method == "ar" or seq.target.computed != len(seq.tokens) - 1:
                continue  # plain method, or a prefill / recompute step
            if vetoed and not seq.spec.observed:
                continue
            if seq.deadline_at is not None and now > seq.deadline_at:
                seq.stats.fallback_reason = "deadline"
                continue
            room = self.max_model_len - len(seq.tokens)  # speculative slots the context allows
            bound = min(room, seq.remaining - 1)
            c = self._candidate(seq, bound) if seq.auto_step is None else self._auto_candidate(seq, bound, b, base)
            if c is not None:
                c.forced = seq.spec.observed  # measured as its setting says (`Candidate.forced`)
                cands.append(c)
                owners.append(seq)
        if not cands:
            return {}
        scale, predicted = self.calibration.scale(b) if self.calibration is not None else 1.0, {}
        chosen = plan(cands, self.cost, batch=len(batch), base_tokens=base, draft_cost=self.draft_cost,
                      fixed_s=self.accounts.fixed_s(len(batch)), margin=self.margin, spec_scale=scale, out=predicted)
        # quiet only after the planner weighed real proposals and said no (an n-gram index with no
        # match now may have one next step)
        if self.schedule.planned(b, offered=any(c.gains for c in cands), speculates=any(chosen)):
            # one sequence runs its best plan, predicted loss or not: the step measures speculating at
            # this batch size at the cost of one sequence's draft. The cheapest probe (least overhead:
            # not a draft cache a whole prompt behind), then the likeliest to gain
            i = max(range(len(cands)),
                    key=lambda j: (bool(cands[j].gains), -round(cands[j].overhead_s, 4),
                                   cands[j].gains[0] if cands[j].gains else -1.0))
            probe = [0] * len(cands)
            probe[i] = plan([cands[i]], self.cost, batch=len(batch), base_tokens=base, draft_cost=self.draft_cost,
                            fixed_s=self.accounts.fixed_s(len(batch)), margin=-1.0, spec_scale=scale, out=predicted)[0]
            chosen = probe
            self.schedule.probed(bool(chosen[i]))
        if any(chosen) and "step_s" in predicted and not self.schedule.probing:  # a probe's catch-up is its own cost
            self._step_pred = (predicted["step_s"], predicted["plain_s"])
        plans: dict[str, dict] = {}
        groups: dict[str, tuple[list[Sequence], list[int], list[dict]]] = {}  # method -> its sequences
        for seq, c, extra in zip(owners, cands, chosen):
            method = seq.spec.method
            seq.stats.gamma = extra
            if extra == 0 or not self.scheduler.grant(seq, extra, extra - 1 if method == "draft" else None):
                plans[seq.request_id] = {"drafts": [], "q": None}
                continue
            # an n-gram draft as the plan weighed it; a tree's levels or nodes and branch (`TreePlans.settle`)
            settled = {"drafts": c.proposal} if method == "ngram" else self.trees.settle(seq, c, extra)
            group = groups.setdefault(method, ([], [], []))
            group[0].append(seq)
            group[1].append(extra)
            group[2].append(settled)
        for method, (seqs, sizes, settled) in groups.items():  # each method's proposer, one call for its group
            c0 = self.cost_clock()
            made = self.proposers[method].propose(seqs, sizes, settled)
            self.accounts.note_proposal(self.cost_clock() - c0)
            for seq, known, m in zip(seqs, settled, made):
                plans[seq.request_id] = {**known, **m.plan}
                seq.stats.draft_s += m.draft_s
                seq.stats.draft_forwards += m.forwards
                # its share of the proposal, and its n-gram lookup (an n-gram draft, a Medusa branch: `_candidate`,
                # `TreePlans.branch_offer`)
                self.accounts.note_share(seq.request_id, m.share_s)
        return plans

    def _note_catch_up(self, drafting: list[Sequence], before: list[int], forwards: list[float], wall_s: float,
                       cost_s: float) -> None:
        """Set `_catch_up`: what this step's first drafting round cost beyond the same round with every
        draft cache at most FULL_CATCH_UP tokens behind (a request's first drafting feeds its whole
        prompt, one after a stretch of plain steps every token since). That cost is paid once per
        request, and the plan charges it spread over the request's steps; counted against the step, it
        read as speculation costing 2-3x its prediction (`SpecCalibration` scale pinned at its 3.0
        ceiling in-process at batch 4) and tripped the veto, so the engine declined, its draft caches
        fell further behind, and the next speculative step paid a longer catch-up."""
        lags = [len(s.tokens) - b for s, b in zip(drafting, before)]
        if not forwards or max(lags) <= FULL_CATCH_UP:
            return
        usual = self.draft_cost.predict(len(drafting), sum(min(lag, FULL_CATCH_UP) for lag in lags))
        extra = max(forwards[0] - usual, 0.0)
        self._catch_up = (extra, extra * wall_s / cost_s if cost_s > 0 else extra)

    def _observe_draft(self, forwards: list[float]) -> Callable[[int, int, float], None]:
        def observe(b: int, t: int, seconds: float) -> None:
            forwards.append(seconds)
            self.draft_cost.observe(b, t, seconds)
        return observe

    @staticmethod
    def _draft_room(seq: Sequence, context: int) -> int:
        """`draft_room` of a drafter with ``context`` positions for ``seq``; at 0 the sequence has
        outgrown it and decodes plainly to the end (``fallback_reason`` "draft_context")."""
        room = draft_room(context, len(seq.tokens))
        if room == 0 and seq.stats.fallback_reason is None:
            seq.stats.fallback_reason = DRAFT_CONTEXT
        return room

    def _auto_candidate(self, seq: Sequence, bound: int, b: int, base: int) -> Candidate | None:
        """The offer of an auto sequence's step: prompt lookup's or its drafter's, the one
        `StepChoice.choose` picks by expected tokens per second of the step (the sequence takes
        that option's method and acceptance state)."""
        auto = seq.auto_step
        offers: dict[str, Candidate] = {}
        for option in (auto.tier, auto.base):
            auto.switch(seq, option)
            c = self._candidate(seq, bound)  # a lookup moves the sequence to its match's tier
            if c is not None and c.gains:
                offers[auto.current] = c
        if not offers:
            return None
        fixed = self.accounts.fixed_s(b)

        def step_s(c: Candidate) -> Callable[[int], float]:  # the step's seconds with k of its drafts
            draft = self.draft_cost.predict(1, 1) if c.draft_rounds else 0.0
            return lambda k: self.cost.predict(b, base + k) + fixed + c.overhead_s + k * draft

        picked = auto.choose({o: rate(c.gains, step_s(c)) for o, c in offers.items()})
        auto.switch(seq, picked)
        return offers[picked]

    def _candidate(self, seq: Sequence, bound: int) -> Candidate | None:
        method = seq.spec.method
        overhead = self.accounts.overhead_s(seq)
        if method == "ngram":
            # a lookup takes ~10 us: timed with the cheap wall clock (cost_clock can be a ~5 us syscall,
            # which would be a third of what it measures); the median over steps drops a preempted one
            t0 = time.perf_counter()
            proposal = seq.ngram.step_drafts(seq.spec.gamma, bound)
            self.accounts.note_lookup(seq.request_id, time.perf_counter() - t0)
            if seq.auto_step is not None:  # auto: the acceptance of this match's tier
                seq.auto_step.switch(seq, ngram_tier(seq.ngram.last_match))
            return Candidate(gains=self.priors.gains(seq.prior_key, method, seq.alpha, len(proposal)),
                             overhead_s=overhead, proposal=proposal)
        if method == "draft":
            room = self._draft_room(seq, self.draft.max_context)
            if room == 0:
                return None
            bound = min(bound, room)
            lag = len(seq.tokens) - seq.draft.computed  # the first round feeds what the draft cache lacks
            feed = min(lag, FULL_CATCH_UP)  # charged to this step's first round (`Candidate.first_feed`)
            if lag > feed:  # a long catch-up (the whole prompt for a request that never drafted): paid once
                # for all its later drafting, so its part past FULL_CATCH_UP is charged spread over the steps it
                # has left if it keeps drafting (a long pause does not lock drafting out; a fresh request at high
                # load is not made to pay a prompt-length draft prefill for one marginal step: that cost 4-6x a
                # plain step at batch 16)
                gamma = max(1, min(seq.spec.gamma, bound))
                per_step = 1.0 + sum(self.priors.gains(seq.prior_key, method, seq.alpha, gamma))  # per drafting step
                steps_left = max(1.0, seq.remaining / per_step)
                overhead += (self.draft_cost.predict(1, lag) - self.draft_cost.predict(1, feed)) / steps_left
            return Candidate(gains=self.priors.gains(seq.prior_key, method, seq.alpha, max(0, min(seq.spec.gamma, bound))),
                             draft_rounds=True,
                             overhead_s=overhead, first_feed=max(feed, 1))
        if method == "eagle":
            room = self._draft_room(seq, self.eagle.max_context)
            if room == 0:
                return None
            if not self.eagle.ready(seq):
                return None
            if seq.eagle.shape is not None:
                return self.trees.tree_candidate(seq, min(bound, room), overhead)
            gamma = max(0, min(seq.spec.gamma, bound, room))
            return Candidate(gains=self.priors.gains(seq.prior_key, method, seq.alpha, gamma), overhead_s=overhead)
        if seq.hidden is None:
            return None
        return self.trees.medusa_candidate(seq, bound, overhead)

    def _feed(self, seq: Sequence, p: dict | None) -> tuple[FeedItem, bool]:
        """The target tokens this sequence feeds; whether the step needs hidden states for it."""
        new = seq.tokens[seq.target.computed :]
        medusa = seq.spec.method == "medusa"
        if p is not None and "tree_tokens" in p:
            buffers = p["buffers"]
            start = len(seq.tokens) - 1  # the root is the pending token
            positions = (start + buffers.depth).tolist()
            item = FeedItem(kv=seq.target, tokens=p["tree_tokens"].tolist(), rows=list(range(buffers.num_nodes)),
                            positions=positions, intra=buffers.attn_mask)
            return item, True
        drafts = [] if p is None else p["drafts"]
        last = len(new) - 1
        if seq.eagle is not None and seq.eagle.active:  # the drafter reads the hidden state of every position
            first = 0 if self.eagle.full_rows(seq) else last
            # the rows before the last pending one need hidden states alone (`FeedItem.hidden_only`)
            return FeedItem(kv=seq.target, tokens=new + drafts, rows=list(range(first, last + len(drafts) + 1)),
                            hidden_only=last - first), True
        return FeedItem(kv=seq.target, tokens=new + drafts, rows=list(range(last, last + len(drafts) + 1))), medusa

    def _commit(self, seq: Sequence, item: FeedItem, out, p: dict | None, verify_s: float,
                greedy_result: tuple[int, int] | None = None) -> StepOutput | None:
        """Verify, append the new tokens, roll caches back; the request's StepOutput (None if none)."""
        stats = seq.stats
        old_len = len(seq.tokens)
        prefill = seq.target.computed - len(item.tokens) < old_len - 1  # fed more than the pending token
        greedy = seq.sampling.greedy
        tree = p is not None and "tree_tokens" in p
        path = None
        if tree:
            tokens, buffers, branch = p["tree_tokens"], p["buffers"], p.get("branch") or []
            # typical: LOSSY, as the request's settings asked
            v = judge_tree(tokens, out.logits, buffers, seq.sampling, seq.generator,
                           TYPICAL if seq.spec.typical else None)
            path = v.path
            new = tokens[path[1:]].tolist() + [v.next_token]
            drafted, accepted = max(buffers.spec.depth, len(branch)), len(path) - 1
            # the heads' tree alone would have accepted the path's own nodes: the walk leaves them only for a
            # branch node, which was appended where none of the tree's children carried its token
            heads_accepted = sum(1 for node in path[1:] if node < buffers.spec.num_nodes)
            self.trees.observe(seq, p, new, accepted, heads_accepted)  # what the estimates expected vs what came
            self.target.compact(seq.target, old_len - 1, path)
            if seq.spec.method == "medusa":
                seq.hidden = out.hidden[path[-1]]
        else:
            drafts = [] if p is None else p["drafts"]
            if greedy:
                n, x = greedy_result  # batched greedy verification (_verify_greedy_batch)
            else:
                q = None if p is None else p["q"]  # [G, V] | None
                n, x = judge_block(out.logits, drafts, q, seq.sampling, seq.generator)
            new = drafts[:n] + [x]
            drafted, accepted = len(drafts), n
            self.target.truncate(seq.target, old_len + n - 1 + 1)  # keep [.., pending, d_1 .. d_n]
            if seq.spec.method == "medusa":
                seq.hidden = out.hidden[n]  # [E]: produced the pending token; the heads read it next step
        gamma = drafted
        step = step_tokens(new[:-1], new[-1], drafted, frozenset() if seq.params.ignore_eos else self.eos)
        drafted, accepted = step.drafted, step.accepted
        reason = "stop" if not seq.params.ignore_eos and step.emitted[-1] in self.eos else None
        new = step.emitted[: seq.remaining]
        seq.tokens.extend(new)
        if seq.ngram is not None:
            seq.ngram.extend(new)
        if seq.eagle is not None:
            self.eagle.commit(seq, deadline_passed=stats.fallback_reason == "deadline", path=path)
        if reason is None and seq.remaining <= 0:
            reason = "length"
        if seq.target.computed > len(seq.tokens) - 1:
            self.target.truncate(seq.target, len(seq.tokens) - 1)
        kv = seq.target
        kv.published = self.pool.publish(kv.blocks, seq.tokens, kv.computed, kv.published)
        if seq.eagle is not None:
            self.eagle.store(seq)  # the published blocks' hidden rows, for sequences that reuse them
        if self.draft is not None and seq.draft.computed > len(seq.tokens) - 1:
            self.draft.truncate(seq.draft, len(seq.tokens) - 1)  # the draft rolls back like the target
        stats.target_forwards += 1
        stats.verify_s += verify_s
        if prefill or old_len == seq.prompt_len:
            stats.prefill_s += verify_s
        elif seq.spec.method == "ar":
            stats.steps += 1
        else:
            stats.record_step(drafted, accepted, gamma=gamma)
            if drafted and not tree:
                trials = accepted + (1 if accepted < drafted else 0)
                seq.acc_hits = SEQ_DECAY * seq.acc_hits + accepted
                seq.acc_trials = SEQ_DECAY * seq.acc_trials + trials
                self.priors.observe_alpha(seq.prior_key, accepted, trials)
                self._update_alpha(seq)
            elif not drafted:  # not speculating: drift back toward its kind's prior, so it is probed again later
                seq.acc_hits *= 1.0 - ALPHA_RECOVERY
                seq.acc_trials *= 1.0 - ALPHA_RECOVERY
                self._update_alpha(seq)
                if overhead_kind(seq) == EAGLE_TREE:
                    self.trees.recover_tree(seq)
                else:
                    seq.accept_scale += ALPHA_RECOVERY * (self.priors.scale(seq.prior_key) - seq.accept_scale)
        stats.record_emitted(len(new))
        if reason is not None:
            return self._finish(seq, reason, new)
        return StepOutput(request_id=seq.request_id, new_token_ids=new, finished=False)

    def _update_alpha(self, seq: Sequence) -> None:
        """The request's own counts shrunk toward its kind's prior (SEQ_PRIOR_TRIALS trials' worth)."""
        prior = self.priors.alpha(seq.prior_key, seq.spec.method)
        seq.alpha = (seq.acc_hits + SEQ_PRIOR_TRIALS * prior) / (seq.acc_trials + SEQ_PRIOR_TRIALS)

    def _finish(self, seq: Sequence, reason: str, new: list[int] | None = None) -> StepOutput:
        if seq.auto_step is not None:  # scored as the drafter admission chose
            seq.auto_step.switch(seq, seq.auto_step.base)
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        stats = seq.stats
        if seq.heads:
            stats.head_predictions, stats.head_correct = head_accuracy(
                seq.head_guesses, seq.tokens[seq.prompt_len :], seq.heads)
        if seq.spec.method in ALPHA_PRIOR and stats.fallback_reason is None and not seq.aborted:
            self._chooser(seq.spec.auto_key, seq.params.temperature > 0).observe(
                seq.spec.method, stats.new_tokens, stats.target_forwards)
        if reason == "stop":
            stats.finish("eos")
        else:
            ctx = seq.budget < seq.params.max_tokens and seq.num_output >= seq.budget
            stats.finish("context" if ctx else "max_new_tokens")
        if stats.steps and seq.spec.method == "ar" and stats.verify_s > stats.prefill_s:
            stats.plain_token_s = (stats.verify_s - stats.prefill_s) / stats.steps
        return StepOutput(request_id=seq.request_id, new_token_ids=new or [], finished=True,
                          finish_reason=reason, record=stats)
