"""Per-request state of the serving engine: parameters, counters, block tables.

A `Sequence` moves its KV counters the way vLLM v1 does, with no prefill/decode phases:

* ``tokens``: the committed tokens, prompt then output (clients only ever see these);
* ``target.computed``: how many leading tokens have their KV in the target cache. While a
  request runs, ``computed == len(tokens) - 1``: the last committed token (the *pending*
  one) is fed again with the next step's drafts. A fresh or preempted request has
  ``computed == 0`` and its first step feeds every token (a prefill, or a recompute).
* a step feeds ``len(tokens) + len(drafts) - computed`` tokens; after verification
  ``computed`` is ``len(tokens) - 1`` again, i.e. it dropped by the rejected drafts.

Each model (target, draft) has its own `SeqKV`: the computed count plus the block table
of that model's paged cache (or, on the generic transformers path, a private runner).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from specops.spec.sampling import SamplingConfig
from specops.spec.stats import DecodeStats
from specops.engine.spec_settings import DEFAULT_TREE_SIZE, SpecSettings  # DEFAULT_TREE_SIZE: re-exported

FINISH_REASONS = ("stop", "length", "abort")


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for output in the engine's ``max_model_len``."""


@dataclass(slots=True)
class SamplingParams:
    """How a request samples and when it stops."""

    max_tokens: int
    """Most new tokens to generate (>= 1)."""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 samples from the filtered distribution."""
    top_p: float | None = None
    """Nucleus filter in (0, 1] (sampling only)."""
    top_k: int | None = None
    """Keep the k most likely tokens (sampling only)."""
    seed: int | None = None
    """Seed of the request's own generator (None: OS entropy)."""
    ignore_eos: bool = False
    """Keep generating past EOS until ``max_tokens``."""

    def config(self) -> SamplingConfig:
        """The validated `SamplingConfig` (raises a ValueError naming the bad field)."""
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {m!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass(slots=True)
class StepOutput:
    """What one `Engine.step` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    """Tokens committed this step (never retracted later)."""
    finished: bool
    finish_reason: str | None = None
    """"stop" (EOS) | "length" (max_tokens or the context) | "abort"; None while running."""
    record: DecodeStats | None = None
    """On finish: the request's stats (method that ran, drafted, accepted, fallback_reason,
    timings); ``record.to_record(request_class)`` gives the telemetry `DecodeRecord`."""


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's queues and KV memory."""

    waiting: int
    running: int
    batch_size: int
    """Sequences in the last step's forward."""
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    preemptions: int = 0
    """Sequences preempted (blocks freed, recomputed later) since start."""
    prefix_cache_hit_blocks: int = 0
    """KV blocks reused from the prefix cache (prompt blocks not recomputed) since start."""
    prefix_deferrals: int = 0
    """Admissions put off a step since start so a prompt reuses blocks that another prompt admitted
    in the same step was computing (`Scheduler._shares_uncached`)."""
    attention_kernel: str = "sdpa"
    """How decode attention reads the paged KV: ``cpu-paged`` (in place) or ``sdpa`` (gathered)."""
    plain_steps: int = 0
    """Decode steps since start in which every sequence decoded plainly."""
    spec_steps: int = 0
    """Decode steps since start in which some sequence speculated."""
    vetoes: int = 0
    """Times the planner's veto stopped speculating at a batch size since start (`PlanSchedule.veto_steps`)."""
    probes: int = 0
    """Cost probes since start: steps where one sequence speculated against the plan (`PlanSchedule.probe_every`)."""
    plain_probes: int = 0
    """Plain probes since start: plain steps at a batch size that always speculated (`PlanSchedule.plain_probe_every`)."""
    medusa_branches: int = 0
    """Greedy Medusa steps since start whose tree carried a prompt-lookup branch (`SpecSettings.lookup_branch`)."""
    medusa_branch_tokens: int = 0
    """Tokens those steps accepted beyond what the heads' tree alone would have: accepted on the
    branch's own nodes."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SeqKV:
    """One model's KV state for one sequence."""

    computed: int = 0
    """Leading tokens of the sequence whose KV entries are valid in this model's cache."""
    blocks: list[int] = field(default_factory=list)
    """Block table: block ids of the paged cache, in position order."""
    runner: Any = None
    """Generic path only: the private `HFRunner` holding this sequence's cache."""
    published: int = 0
    """Leading blocks registered in the prefix cache."""


@dataclass(slots=True)
class Sequence:
    """One request inside the engine."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    spec: SpecSettings
    sampling: SamplingConfig
    generator: Any  # torch.Generator
    arrival: float
    budget: int
    """Most output tokens: min(max_tokens, max_model_len - prompt_len)."""
    stats: DecodeStats
    deadline_at: float | None = None
    status: SeqStatus = SeqStatus.WAITING
    target: SeqKV = field(default_factory=SeqKV)
    draft: SeqKV = field(default_factory=SeqKV)
    aborted: bool = False
    finish_reason: str | None = None
    alpha: float = 0.7
    """Running estimate of the per-token acceptance probability (load-aware γ): decayed
    accepted drafts over decayed trials (`acc_hits`, `acc_trials`), shrunk toward its kind's prior."""
    acc_hits: float = 0.0
    """Decayed accepted draft tokens of this request's linear rounds."""
    acc_trials: float = 0.0
    """Decayed trials: each accepted token, plus the rejection that ended a round early."""
    accept_scale: float = 1.0
    """Medusa: running ratio of accepted tokens to the tree's expected accepted tokens (the
    heads' accuracy table is an average; this request may do better or worse). EAGLE-2 trees:
    accepted tokens per token the drafter expected (`TreePlans.observe_tree`)."""
    prior_key: tuple = ()
    """(request class, method, sampled): its kind in the engine's `AcceptancePriors`."""
    hidden: Any = None
    """Medusa: target hidden state [E] that produced the pending token."""
    ngram: Any = None
    """Ngram: the request's `NgramIndex`."""
    heads: int = 0
    """Medusa: heads in use."""
    head_guesses: list = field(default_factory=list)
    """Medusa: (output index, head, top-1 token) of every proposal, for per-head accuracy."""
    eagle: Any = None
    """Eagle: the request's drafter state (`specops.engine.eagle_proposer.EagleState`)."""
    auto_step: Any = None
    """Auto on a chain drafter: its choice between prompt lookup and that drafter before each step
    (`specops.engine.auto_method.StepChoice`)."""

    @property
    def needs_all_hidden(self) -> bool:
        """Whether the target's hidden state of every token is kept (an EAGLE drafter that still
        drafts): a (re)admission then reuses only cached prompt blocks whose hidden rows are kept
        (`specops.engine.eagle_proposer.EagleProposer.store`) and computes the rest."""
        return self.eagle is not None and self.eagle.active

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.budget - self.num_output
