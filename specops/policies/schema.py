"""The policy schema: typed, validated objects built from a YAML policy.

A policy says, per request class, how to speculate (method, γ, Medusa heads, tree
size), which bounds the adaptive controller may move those knobs within, when to
alert, and how a new policy is rolled out (canary steps with analysis).

Unknown fields are rejected everywhere (typos must not be silently ignored).
Checks that involve several fields (``min <= initial <= max``, references between
classes, alerts and the rollout analysis) run after the per-field checks; the
loader reports all of them with file, line and field path (see ``loader.py``).
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specops.policies.turns import resolve_turn

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"

Method = Literal["draft", "medusa", "ngram", "eagle", "auto", "off"]
AdaptationMode = Literal["fixed", "goodput", "bandit"]
AlertMetric = Literal["acceptance_rate", "speedup", "head_accuracy", "tokens_per_s", "p99_token_latency_s"]
AlertOp = Literal["<", "<=", ">", ">="]
AlertAction = Literal["fallback", "rollback", "notify"]
Severity = Literal["critical", "warning", "info"]

# Metrics that are ratios in [0, 1]; their thresholds must be too.
RATIO_METRICS = frozenset({"acceptance_rate", "head_accuracy"})

# Context key under which Policy's cross-reference checks append (loc, message)
# instead of raising, so the loader can report them with precise paths and lines.
ISSUES_CONTEXT_KEY = "specops_issues"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class IntRange(_Model):
    """An integer knob: where it starts and the bounds the controller may move it within."""

    initial: int = Field(ge=0, le=1024)
    """Value used until the controller has measured enough to adapt."""
    min: int = Field(ge=0, le=1024)
    """Lowest value the controller may choose."""
    max: int = Field(ge=0, le=1024)
    """Highest value the controller may choose."""

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"initial ({self.initial}) must lie within min..max ({self.min}..{self.max})")
        return self

    def clamp(self, value: int) -> int:
        """``value`` limited to ``[min, max]``."""
        return max(self.min, min(self.max, value))


LOOKUP_BRANCH = 4
"""The prompt-lookup branch's usual length when a class does not set one (the decoder's own
default, `specops.spec.medusa_branch.LOOKUP_BRANCH`; this layer does not import the runtime)."""

CHARS_PER_TOKEN = 4
"""Characters per token where a prompt's length must be estimated without a tokenizer (the
sidecar's routing, `specops policy classify`)."""


class FloatRange(_Model):
    """A closed interval of floats."""

    min: float = Field(ge=0.0, allow_inf_nan=False)
    """Lower bound (inclusive)."""
    max: float = Field(ge=0.0, allow_inf_nan=False)
    """Upper bound (inclusive)."""

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max


class TurnRange(_Model):
    """Conversation turns a rule matches (turn = assistant messages before the request + 1)."""

    min: int = Field(default=1, ge=1)
    """First turn matched (1 = the first reply)."""
    max: int | None = Field(default=None, ge=1)
    """Last turn matched; omit (null) for no upper bound."""

    @model_validator(mode="after")
    def _ordered(self) -> TurnRange:
        if self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self

    def contains(self, turn: int) -> bool:
        return turn >= self.min and (self.max is None or turn <= self.max)


MATCH_CONDITIONS = ("prefix", "regex", "label", "min_prompt_tokens", "max_prompt_tokens", "turn", "temperature")
"""The fields of a `MatchRule` that are conditions (a rule needs at least one)."""


class MatchRule(_Model):
    """One way a request can belong to a class; all conditions given in a rule must hold.

    A class matches when any of its rules matches. Give at least one condition.
    """

    prefix: str | None = Field(default=None, min_length=1)
    """The prompt starts with this text."""
    regex: str | None = Field(default=None, min_length=1)
    """Python regular expression searched anywhere in the prompt."""
    label: dict[str, str] | None = Field(default=None, min_length=1)
    """Request labels / headers that must all be present with these exact values."""
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    """The prompt has at least this many tokens."""
    max_prompt_tokens: int | None = Field(default=None, ge=0)
    """The prompt has at most this many tokens."""
    turn: TurnRange | None = None
    """Conversation turn (see ``specops.policies.turns``): from chat ``messages``, or the
    ``turn`` label of a plain completion. A request whose turn is unknown never matches."""
    temperature: FloatRange | None = None
    """The request's sampling temperature is in this range (0 = greedy; an OpenAI request
    that omits it samples at 1.0). Sampled requests accept far fewer drafted tokens than
    greedy ones of the same text, so a class of their own keeps each class's acceptance
    (and the alerts on it) about one kind of traffic. A request whose temperature is
    unknown never matches."""

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid regular expression: {exc}") from None
        return value

    def conditions(self) -> list[str]:
        """The conditions this rule tests, in `MATCH_CONDITIONS` order."""
        return [name for name in MATCH_CONDITIONS if getattr(self, name) is not None]

    @model_validator(mode="after")
    def _has_condition(self) -> MatchRule:
        if not self.conditions():
            raise ValueError(f"a match rule needs at least one of {', '.join(MATCH_CONDITIONS)}")
        if (self.min_prompt_tokens is not None and self.max_prompt_tokens is not None
                and self.min_prompt_tokens > self.max_prompt_tokens):
            raise ValueError(f"min_prompt_tokens ({self.min_prompt_tokens}) must be <= max_prompt_tokens ({self.max_prompt_tokens})")
        return self

    def matches(self, prompt: str, labels: dict[str, str], prompt_tokens: int, turn: int | None = None,
                temperature: float | None = None) -> bool:
        if self.turn is not None and (turn is None or not self.turn.contains(turn)):
            return False
        if self.temperature is not None and (temperature is None or not self.temperature.contains(temperature)):
            return False
        if self.prefix is not None and not prompt.startswith(self.prefix):
            return False
        if self.regex is not None and re.search(self.regex, prompt) is None:
            return False
        if self.label is not None and any(labels.get(k) != v for k, v in self.label.items()):
            return False
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        return True


class TelemetryOptions(_Model):
    """Optional, bounded extra telemetry labels."""

    turn_label: bool = False
    """Also export per-turn series labelled ``turn`` = ``1`` / ``2`` / ``3+`` (bounded)."""


class Adaptation(_Model):
    """How the controller adapts a class's knobs, and how hard it is held back from flapping."""

    mode: AdaptationMode = "goodput"
    """``fixed``: keep the initial values; ``goodput``: pick the setting with the highest
    expected tokens/s from measured acceptance and costs; ``bandit``: UCB over the allowed settings."""
    dead_band: float = Field(default=0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    """Relative improvement (0.05 = 5%) a new setting must promise before the controller switches."""
    cooldown_s: float = Field(default=60.0, ge=0.0, allow_inf_nan=False)
    """Minimum seconds between two changes of this class's settings."""
    max_step: int = Field(default=2, ge=1, le=64)
    """Largest change of γ (or heads, or tree size) in one tick."""
    probe_fraction: float = Field(default=0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    """Share of the class's traffic that keeps speculating while the class is fallen back,
    so the controller can see when speculation pays again."""


class RequestClass(_Model):
    """A kind of request (code completion, chat, creative writing...) and how to decode it."""

    name: str = Field(pattern=NAME_PATTERN)
    """Class name: lowercase letters, digits, ``_ . -``; used as a metric label and Redis key."""
    match: list[MatchRule] = Field(default_factory=list)
    """Rules that put a request in this class (checked in class order; first match wins).
    Empty: only requests that fall through to the default class."""
    method: Method = "draft"
    """Speculation method: ``draft`` model, ``medusa`` heads, ``ngram`` prompt lookup, ``eagle``
    feature drafter (`specops serve --eagle`), ``auto`` (per request and step, whichever of those
    pays; lossless), or ``off``. A method whose model part the server has not loaded (draft model,
    Medusa heads, EAGLE drafter) decodes plainly (fallback reason ``model_part_missing``)."""
    gamma: IntRange = IntRange(initial=4, min=1, max=8)
    """Speculation length γ (draft, n-gram and eagle methods); min must be at least 1. The controller
    keeps the class's live γ within [min, max]. `specops serve`'s engine reads the live γ as a
    cap: its planner drafts fewer tokens each step, down to none, where more would not pay at
    that step's load (so ``min`` bounds the controller, not a step)."""
    medusa_heads: IntRange = IntRange(initial=3, min=1, max=4)
    """Number of Medusa heads used (medusa method); min must be at least 1."""
    tree_size: IntRange = IntRange(initial=16, min=4, max=64)
    """Nodes in the Medusa candidate tree (medusa method), or in the EAGLE-2 tree (``eagle_topk``);
    min must be at least 1. A greedy request's prompt-lookup branch (``lookup_branch``) counts
    against it in `specops serve`'s engine."""
    eagle_topk: int | None = Field(default=None, ge=1, le=32)
    """Eagle (and auto) classes, greedy requests: draft EAGLE-2's dynamic tree instead of a chain,
    expanding this many nodes per level, each with this many children, at most ``gamma`` levels deep
    and ``tree_size`` nodes (both the class's live values; the controller adapts the tree size of an
    eagle class that sets this, as a Medusa class's). Exact: the output stays the target's. Sampled
    requests keep the chain. None (default): the chain."""
    lookup_branch: int = Field(default=LOOKUP_BRANCH, ge=0, le=64)
    """Medusa, greedy requests: where the context's last three tokens occurred before, this many
    of the tokens that followed them (two or three times as many after a match that runs back 8 or
    16 tokens) join each step's tree as one more branch, verified by the same forward. Exact: the
    output stays the target's. 0: the heads' tree alone."""
    typical: bool = False
    """Medusa, sampled requests: **LOSSY** typical acceptance (Medusa §3.3): a candidate is accepted
    when the target finds it plausible enough, instead of by exact rejection sampling, so the output
    is no longer distributed as the target's own sampling. Off by default; greedy requests ignore it
    (greedy verification is exact already); only a ``method: medusa`` (or ``off``) class may set it."""
    temperature: FloatRange = FloatRange(min=0.0, max=2.0)
    """Sampling temperatures this class speculates for; requests outside decode plainly."""
    deadline_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """Decode deadline in seconds; past it the request continues with plain decoding. None: no deadline."""
    adaptation: Adaptation = Adaptation()
    """How the controller adapts this class's knobs."""

    @field_validator("method", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `method: off` (the spelling this schema's own messages use) as
        # False; `off` is the only method that a YAML boolean can stand for
        return "off" if value is False else value

    @field_validator("gamma", "medusa_heads", "tree_size")
    @classmethod
    def _at_least_one(cls, value: IntRange, info: ValidationInfo) -> IntRange:
        if value.min < 1:
            raise ValueError(f"min must be at least 1 for {info.field_name} (use method: off to disable speculation)")
        return value

    @field_validator("eagle_topk")
    @classmethod
    def _topk_on_eagle(cls, value: int | None, info: ValidationInfo) -> int | None:
        method = info.data.get("method")
        if value is not None and method is not None and method not in ("eagle", "auto", "off"):
            raise ValueError(f"eagle_topk shapes the eagle method's tree; this class's method is {method!r} "
                             f"(remove eagle_topk, or use method: eagle)")
        return value

    @field_validator("typical")
    @classmethod
    def _typical_on_medusa(cls, value: bool, info: ValidationInfo) -> bool:
        method = info.data.get("method")
        if value and method is not None and method not in ("medusa", "off"):  # off: a Medusa class switched off
            raise ValueError(f"typical acceptance is lossy and applies to the medusa method only; "
                             f"this class's method is {method!r} (remove typical, or use method: medusa)")
        return value

    def speculates_at(self, temperature: float) -> bool:
        """Whether a request at ``temperature`` uses this class's speculation method."""
        return self.method != "off" and self.temperature.contains(temperature)


class AlertRule(_Model):
    """An alert: a metric compared with a threshold for long enough, with enough samples."""

    name: str = Field(pattern=NAME_PATTERN)
    """Rule name (unique); used in alert labels and in ``rollout.analysis.rules``."""
    metric: AlertMetric
    """Derived metric watched (definitions in ``specops.telemetry.contract``)."""
    op: AlertOp
    """Comparison that makes the alert condition true: ``metric op threshold``."""
    threshold: float = Field(allow_inf_nan=False)
    """Threshold; ratios (acceptance_rate, head_accuracy) lie in [0, 1], others are >= 0."""
    for_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """How long (seconds) the condition must hold before the alert fires."""
    min_samples: int = Field(default=0, ge=0)
    """Drafted tokens needed in the window; with fewer the result is inconclusive."""
    action: AlertAction = "notify"
    """What the controller does when it fires: ``fallback`` the class to plain decoding,
    ``rollback`` the policy to the last good revision, or only ``notify``."""
    severity: Severity = "warning"
    """Alert severity label."""
    classes: list[str] | None = None
    """Classes the rule watches; omit (null) for all classes."""

    @field_validator("threshold")
    @classmethod
    def _threshold_in_range(cls, value: float, info: ValidationInfo) -> float:
        metric = info.data.get("metric")
        if metric in RATIO_METRICS and not 0.0 <= value <= 1.0:
            raise ValueError(f"{metric} is a ratio: threshold must lie in [0, 1], got {value}")
        if metric is not None and metric not in RATIO_METRICS and value < 0:
            raise ValueError(f"threshold for {metric} must be >= 0, got {value}")
        return value

    def holds(self, value: float) -> bool:
        """Whether ``value`` satisfies the alert condition (``value op threshold``)."""
        if self.op == "<":
            return value < self.threshold
        if self.op == "<=":
            return value <= self.threshold
        if self.op == ">":
            return value > self.threshold
        return value >= self.threshold

    def applies_to(self, request_class: str) -> bool:
        return self.classes is None or request_class in self.classes


class RolloutStep(_Model):
    """One canary step: send ``weight`` percent of traffic to the new revision, then wait."""

    weight: int = Field(ge=0, le=100)
    """Percent of traffic on the canary revision during this step."""
    pause_s: float | None = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Seconds to stay at this step before advancing; null pauses until ``specops policy promote``."""
    analysis: bool = True
    """Run the rollout analysis during this step (a failure rolls back automatically)."""


class Analysis(_Model):
    """Canary analysis, run every ``interval_s`` during steps that ask for it (as in Argo Rollouts)."""

    interval_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    """Seconds between two analysis runs."""
    window_s: float = Field(default=300.0, gt=0.0, allow_inf_nan=False)
    """Metrics window each run looks at."""
    failure_limit: int = Field(default=0, ge=0)
    """Failed runs tolerated; one more marks the rollout degraded and rolls it back."""
    inconclusive_limit: int = Field(default=0, ge=0)
    """Inconclusive runs tolerated; one more pauses the rollout for a human."""
    consecutive_error_limit: int = Field(default=4, ge=0)
    """Consecutive runs whose metric source could not be read (Inconclusive, unreachable) during which the
    rollout holds at its step; one more pauses it for a human. Never a rollback: a monitoring outage says
    nothing about the canary."""
    rules: list[str] = Field(default_factory=list)
    """Alert rule names evaluated by the analysis; empty: all alert rules."""


class Rollout(_Model):
    """How a new revision of this policy replaces the current one."""

    steps: list[RolloutStep] = Field(default_factory=lambda: [RolloutStep(weight=100)], min_length=1)
    """Canary steps, weights strictly increasing and at most 100. After the last step the
    canary becomes the stable revision (100%)."""
    analysis: Analysis = Analysis()
    """Analysis settings shared by all steps."""

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[RolloutStep]) -> list[RolloutStep]:
        for i in range(1, len(steps)):
            if steps[i].weight <= steps[i - 1].weight:
                raise ValueError(
                    f"weights must increase from step to step: steps[{i}].weight ({steps[i].weight}) "
                    f"<= steps[{i - 1}].weight ({steps[i - 1].weight})")
        return steps


class Upstreams(_Model):
    """Engine pools behind ``specops sidecar`` (names given with ``--upstream NAME=URL``)."""

    spec: str = Field(default="spec", pattern=NAME_PATTERN)
    """Pool that runs the engine with speculation on: speculating classes and probes go here."""
    plain: str = Field(default="plain", pattern=NAME_PATTERN)
    """Pool that decodes plainly: fallen-back classes, ``method: off`` and out-of-range temperatures."""
    failover: bool = True
    """When a pool is down, send its requests to the other pool (else answer 502)."""


class Policy(_Model):
    """A versioned speculation policy for a fleet."""

    version: str = Field(min_length=1, max_length=200)
    """Version label of this policy (free text, e.g. ``2024-06-01.1``); numbers are accepted as text."""
    description: str = ""
    """What this policy is for."""
    default_class: str
    """Class used for requests that match no class's rules; must be one of ``classes``."""
    classes: list[RequestClass] = Field(min_length=1)
    """Request classes, in match order."""
    alerts: list[AlertRule] = Field(default_factory=list)
    """Alert rules."""
    rollout: Rollout = Rollout()
    """Canary rollout of this policy."""
    upstreams: Upstreams | None = None
    """Engine pools for ``specops sidecar`` (vLLM / SGLang pods); None: pools named ``spec`` and ``plain``."""
    telemetry: TelemetryOptions = TelemetryOptions()
    """Optional extra telemetry labels (off by default: no added cardinality)."""

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, (datetime.date, datetime.datetime)):  # unquoted `version: 2024-06-01`
            return value.isoformat()
        return value

    @model_validator(mode="after")
    def _references(self, info: ValidationInfo) -> Policy:
        issues = cross_reference_issues(self)
        if not issues:
            return self
        sink = info.context.get(ISSUES_CONTEXT_KEY) if isinstance(info.context, dict) else None
        if isinstance(sink, list):
            sink.extend(issues)
            return self
        raise ValueError("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in issues))

    def get_class(self, name: str) -> RequestClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(f"no request class named {name!r} in policy {self.version!r}")

    @property
    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]

    def classify(self, prompt: str, labels: dict[str, str] | None = None, prompt_tokens: int = 0,
                 turn: int | None = None, temperature: float | None = None) -> RequestClass:
        """The first class (in order) with a matching rule, else the default class.

        ``turn``: the conversation turn (`specops.policies.turns.turn_from_messages`);
        None falls back to the ``turn`` label, else the turn is unknown. ``temperature``:
        the request's sampling temperature; None (unknown) matches no temperature rule."""
        return self.match(prompt, labels, prompt_tokens, turn, temperature)[0]

    def match(self, prompt: str, labels: dict[str, str] | None = None, prompt_tokens: int = 0,
              turn: int | None = None, temperature: float | None = None) -> tuple[RequestClass, int | None]:
        """`classify`'s class and the index of its rule that matched (None: the default class,
        reached because no rule matched)."""
        labels = labels or {}
        turn = resolve_turn(turn, labels)
        for c in self.classes:
            for index, rule in enumerate(c.match):
                if rule.matches(prompt, labels, prompt_tokens, turn, temperature):
                    return c, index
        return self.get_class(self.default_class), None

    def analysis_rules(self) -> list[AlertRule]:
        """Alert rules the rollout analysis evaluates."""
        wanted = self.rollout.analysis.rules
        return [a for a in self.alerts if not wanted or a.name in wanted]


def cross_reference_issues(policy: Policy) -> list[tuple[tuple[str | int, ...], str]]:
    """Problems that involve more than one part of the policy, as (location, message)."""
    issues: list[tuple[tuple[str | int, ...], str]] = []
    names = policy.class_names
    known_classes = ", ".join(dict.fromkeys(names))
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            issues.append((("classes", i, "name"), f"duplicate class name {name!r}"))
        seen.add(name)
    if policy.default_class not in seen:
        issues.append((("default_class",), f"unknown class {policy.default_class!r} (classes: {known_classes})"))
    alert_names: set[str] = set()
    for i, alert in enumerate(policy.alerts):
        if alert.name in alert_names:
            issues.append((("alerts", i, "name"), f"duplicate alert name {alert.name!r}"))
        alert_names.add(alert.name)
        for j, cls_name in enumerate(alert.classes or []):
            if cls_name not in seen:
                issues.append((("alerts", i, "classes", j), f"unknown class {cls_name!r} (classes: {known_classes})"))
    for i, rule in enumerate(policy.rollout.analysis.rules):
        if rule not in alert_names:
            known = ", ".join(sorted(alert_names)) or "none defined"
            issues.append((("rollout", "analysis", "rules", i), f"unknown alert rule {rule!r} (alerts: {known})"))
    return issues
