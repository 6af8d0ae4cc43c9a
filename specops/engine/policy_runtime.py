"""The runtime side of the ops contract: resolve a request's settings, record its telemetry.

Two steps, shared by the server (`specops.engine.async_engine`) and the in-process
path (`PolicyRuntime.serve`, used by tests and the library):

``resolve``
    1. classify the prompt with the policy of the revision that serves it
       (`Policy.classify` over the text, labels and prompt length);
    2. route: the canary revision for ``weight``% of routing keys during a rollout,
       else the stable one (`pick_revision`, a stable hash of the key);
    3. settings for the class: the controller's live `EffectiveSettings` for the
       stable revision, the canary policy's initial values for the canary;
    4. speculation off (plain ``ar``) when the method is ``off``, the temperature is
       outside the class's range, the method's model part is missing, or the class
       is fallen back — except a ``probe_fraction`` share that keeps speculating so
       the controller sees when it pays again;
    5. → a `Resolution`: method, γ / heads / tree size with the class's bounds, the
       Medusa prompt-lookup branch and typical acceptance (LOSSY; sampled Medusa requests
       only), an eagle class's EAGLE-2 tree width (``eagle_topk``: its greedy requests draft
       trees γ deep and tree size wide), the decode deadline, and who decided (revision,
       canary, probe, reason).

``record``
    a finished request's `DecodeRecord` (fallback reason filled in) goes to the
    Prometheus exporter at once and to a bounded `RecordBuffer` for Redis, flushed
    by whoever polls (`flush()`), so a Redis outage never blocks decoding.

Resolve never touches Redis: it reads `LivePolicy`'s last good state
(fail-static; see `specops.policies.live`). Torch is used only through the
decoder in `serve`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specops.policies.rollout import effective_for, pick_revision
from specops.policies.schema import Policy, RequestClass
from specops.policies.state import EffectiveSettings
from specops.policies.live import LivePolicy
from specops.engine.spec_settings import SpecSettings
from specops.telemetry.record_buffer import RecordBuffer
from specops.telemetry.records import GAMMA_METHODS
from specops.policies.turns import resolve_turn, turn_bucket

log = logging.getLogger(__name__)

#: fallback reasons recorded on requests that ran plainly because of the policy
REASON_FALLBACK = "policy_fallback"
REASON_OFF = "method_off"
REASON_TEMPERATURE = "temperature_out_of_range"
REASON_MISSING = "model_part_missing"


@dataclass(frozen=True)
class Resolution:
    """How one request is decoded, and why (the ``specops`` object of a response). ``spec`` is the
    request's speculation, the one settings type the engine takes as it is (`Engine.add`) and the
    in-process path hands to `Decoder.generate`; the rest says where it came from."""

    request_class: str
    spec: SpecSettings          # method (ar | draft | ngram | medusa | eagle | auto), live γ, heads, tree, ...
    revision: int | None        # the policy revision that served it
    canary: bool
    probe: bool                 # speculated although the class is fallen back
    fallback_reason: str | None
    turn: int | None = None         # conversation turn used for classification (None: unknown)
    turn_label: str | None = None   # bounded telemetry label (1 / 2 / 3+) when the policy asks for it

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def gamma(self) -> int:
        return self.spec.gamma

    @property
    def heads(self) -> int | None:
        return self.spec.medusa_heads

    @property
    def typical(self) -> bool:
        return self.spec.typical

    def as_dict(self) -> dict[str, Any]:
        return {"request_class": self.request_class, "method": self.method, "revision": self.revision,
                "canary": self.canary, "probe": self.probe, "fallback_reason": self.fallback_reason,
                "gamma": self.gamma if self.method in GAMMA_METHODS else None,
                "medusa_heads": self.heads if self.method == "medusa" else None, "turn": self.turn,
                "typical": self.typical}


@dataclass(frozen=True)
class ServedRequest:
    """What `PolicyRuntime.serve` did for one request."""

    tokens: list[int]
    request_class: str
    method: str            # the method that actually ran (ar when speculation was off)
    revision: int | None   # the policy revision that served it
    canary: bool
    probe: bool            # speculated although the class is fallen back
    fallback_reason: str | None
    stats: Any             # specops.spec.stats.DecodeStats
    turn: int | None = None          # conversation turn used for classification (None: unknown)
    turn_label: str | None = None    # bounded telemetry label (1 / 2 / 3+) when the policy asks for it


class PolicyRuntime:
    """Resolve requests under the live policy and record their telemetry (see module docstring).

    ``policy``: the bootstrap policy, used until (and whenever) the store has none;
    ``store``: a `PolicyStore`, or None for the fixed ``policy`` alone; ``live``: a
    `LivePolicy` over it (made here with ``reconcile_s`` when not given);
    ``publisher`` / ``canary_publisher``: `RedisPublisher`s for the stable and canary
    telemetry namespaces (through a `RecordBuffer`); ``exporter``: a `PrometheusExporter`.
    ``decoder``: provides the model parts (``draft``, ``medusa``, ``eagle``) and runs `serve`.
    """

    def __init__(self, decoder: Any, policy: Policy | None = None, *, store: Any = None, live: LivePolicy | None = None,
                 publisher: Any = None, canary_publisher: Any = None, exporter: Any = None,
                 records: RecordBuffer | None = None, reconcile_s: float = 5.0,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.time) -> None:
        if policy is None and store is None and live is None:
            raise ValueError("PolicyRuntime needs a policy or a policy store")
        self.decoder = decoder
        self.fixed_policy = policy
        if live is None and store is not None:
            live = LivePolicy(store, reconcile_s=reconcile_s)
        self.live = live
        self.store = store if store is not None else (live.store if live is not None else None)
        self.records = records if records is not None else RecordBuffer(publisher, canary_publisher)
        self.exporter = exporter
        self.rng = rng or random.Random(0)
        self.clock = clock
        self._turn_exporter: Any = None  # per-turn series, created when a policy asks for them

    # -- capabilities of the loaded models ---------------------------------------------
    @property
    def has_draft(self) -> bool:
        return getattr(self.decoder, "draft", None) is not None

    @property
    def has_eagle(self) -> bool:
        return getattr(self.decoder, "eagle", None) is not None

    @property
    def medusa_heads_loaded(self) -> int:
        heads = getattr(self.decoder, "medusa", None)
        return 0 if heads is None else int(heads.config.num_heads)

    # -- resolve -----------------------------------------------------------------------
    def _policy(self, revision: int | None) -> Policy:
        if revision is not None and self.live is not None:
            found = self.live.policy(revision)
            if found is not None:
                return found
        if self.fixed_policy is None:
            raise RuntimeError("no policy yet: the store has no current revision and no bootstrap policy was given")
        return self.fixed_policy

    def _route(self, routing_key: str) -> tuple[int | None, bool]:
        if self.live is None or self.live.stable_revision is None:
            return None, False
        stable = self.live.stable_revision
        chosen = pick_revision(self.live.rollout, stable, routing_key)
        if chosen != stable and self.live.policy(chosen) is None:
            return stable, False  # the canary's policy never loaded: serve it stable
        return chosen, chosen != stable

    def _settings(self, policy: Policy, rc: RequestClass, revision: int | None, canary: bool) -> EffectiveSettings:
        if not canary and self.live is not None:
            live = self.live.settings_for(rc.name)
            if live is not None:
                return live
        return effective_for(policy, revision or 0, self.clock())[rc.name]

    def _method(self, rc: RequestClass, s: EffectiveSettings, temperature: float) -> tuple[str, bool, str | None]:
        """(method to run, is a probe, fallback reason)."""
        if s.method == "off":
            return "ar", False, REASON_OFF
        if not rc.temperature.min <= temperature <= rc.temperature.max:
            return "ar", False, REASON_TEMPERATURE
        if s.method == "draft" and not self.has_draft:
            return "ar", False, REASON_MISSING
        if s.method == "medusa" and self.medusa_heads_loaded == 0:
            return "ar", False, REASON_MISSING
        if s.method == "eagle" and not self.has_eagle:
            return "ar", False, REASON_MISSING
        if s.fallback_active:
            if self.rng.random() < s.probe_fraction:
                return s.method, True, None
            return "ar", False, REASON_FALLBACK
        return s.method, False, None

    def resolve(self, text: str, prompt_tokens: int, *, labels: dict[str, str] | None = None,
                routing_key: str | None = None, temperature: float = 0.0, turn: int | None = None) -> Resolution:
        """Settings for one request from the last good policy state (never touches Redis).

        ``turn``: the conversation turn (`specops.policies.turns.turn_from_messages` for chat
        requests); None falls back to the ``turn`` label (unknown: no turn rule matches)."""
        turn = resolve_turn(turn, labels)
        key = routing_key if routing_key is not None else f"{self.rng.random():.12f}"
        revision, canary = self._route(key)
        policy = self._policy(revision)
        rc = policy.classify(text, labels or {}, prompt_tokens, turn, temperature)
        settings = self._settings(policy, rc, revision, canary)
        method, probe, reason = self._method(rc, settings, temperature)
        loaded = max(1, self.medusa_heads_loaded)
        # a canary's or a fallback probe's speculation is being measured (``observed``: the engine's veto spares it)
        spec = SpecSettings(method=method, gamma=settings.gamma, medusa_heads=min(settings.medusa_heads, loaded),
                            tree_size=settings.tree_size, lookup_branch=rc.lookup_branch,
                            typical=rc.typical and method == "medusa" and temperature > 0,
                            eagle_topk=rc.eagle_topk if method in ("eagle", "auto") else None,
                            deadline_s=rc.deadline_s, auto_key=rc.name, observed=canary or probe)
        return Resolution(request_class=rc.name, spec=spec, revision=revision, canary=canary, probe=probe,
                          fallback_reason=reason, turn=turn,
                          turn_label=turn_bucket(turn) if policy.telemetry.turn_label else None)

    # -- record ------------------------------------------------------------------------
    def record(self, resolution: Resolution, record: Any) -> Any:
        """Account one finished request's `DecodeRecord`; returns the record as published."""
        if resolution.fallback_reason is not None and not record.fallback_reason:
            record = replace(record, fallback_reason=resolution.fallback_reason)
        if record.request_class != resolution.request_class:
            record = replace(record, request_class=resolution.request_class)
        if self.exporter is not None:
            self.exporter.observe(record)
            if resolution.turn_label is not None:  # per-turn series only when the policy asks for them
                if self._turn_exporter is None:
                    from specops.telemetry.turn_metrics import TurnExporter

                    self._turn_exporter = TurnExporter(self.exporter.registry)
                self._turn_exporter.observe(record, resolution.turn)
        self.records.add(record, canary=resolution.canary)
        return record

    def poll(self) -> None:
        """Refresh the policy state (notifications, reconcile, backoff) and flush buffered records."""
        if self.live is not None:
            self.live.poll()
        self.records.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.close()

    # -- the in-process path -----------------------------------------------------------
    def serve(self, prompt: str | list[int], *, labels: dict[str, str] | None = None, routing_key: str | None = None,
              temperature: float = 0.0, max_new_tokens: int = 128, top_k: int | None = None,
              top_p: float | None = None, seed: int | None = None, eos_token_id: int | list[int] | None = None,
              turn: int | None = None) -> ServedRequest:
        """Decode one request with `Decoder.generate` under the policy and record its telemetry.

        ``turn``: the conversation turn (`specops.policies.turns.turn_from_messages` for
        chat requests); None falls back to the ``turn`` label."""
        tokenizer = getattr(self.decoder, "tokenizer", None)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("a text prompt needs the decoder's tokenizer; pass token ids instead")
            text, ids = prompt, tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            text = tokenizer.decode(ids) if tokenizer is not None else ""
        self.poll()
        res = self.resolve(text, len(ids), labels=labels, routing_key=routing_key, temperature=temperature,
                           turn=turn)
        spec = res.spec
        kwargs: dict[str, Any] = {}
        if spec.method in GAMMA_METHODS:
            kwargs["gamma"] = spec.gamma
            if spec.eagle_tree() is not None:  # greedy requests draft the tree; sampled ones keep the chain
                kwargs["eagle_tree"] = spec.eagle_tree()
        elif spec.method == "medusa":
            kwargs["heads"] = spec.medusa_heads
            kwargs["tree"] = spec.tree_size  # upper bound on the tree's nodes; the runtime may plan fewer
            kwargs["lookup_branch"] = spec.lookup_branch
            kwargs["typical"] = spec.typical
        out = self.decoder.generate(ids, method=spec.method, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                                    deadline_s=spec.deadline_s, **kwargs)
        stats = out.stats
        if res.fallback_reason is not None and stats.fallback_reason is None:
            stats.fallback_reason = res.fallback_reason
        self.record(res, stats.to_record(res.request_class))
        self.records.flush()
        return ServedRequest(tokens=list(out.tokens), request_class=res.request_class, method=stats.method,
                             revision=res.revision, canary=res.canary, probe=res.probe,
                             fallback_reason=stats.fallback_reason, stats=stats, turn=res.turn,
                             turn_label=res.turn_label)
