"""The runtime side of the ops contract: classify, apply the live settings, decode, publish.

An inference pod wraps its `Decoder` in a `PolicyRuntime`. For every request it

1. classifies the prompt with the current policy (`Policy.classify`);
2. picks the revision that serves it — the canary for ``weight``% of routing keys
   during a rollout, else the stable one — and that revision's settings for the
   class: the controller's live `EffectiveSettings` (via a `SettingsWatcher`, which
   follows change notifications and reconciles periodically) for the stable
   revision, the canary policy's initial values for the canary;
3. turns speculation off when the class is fallen back (except for a
   ``probe_fraction`` share of requests that keep speculating, so the controller can
   see when it pays again), when the method is ``off``, when the request's
   temperature is outside the class's range, or when the method's model part is
   missing (no draft / no Medusa heads);
4. decodes with the class's γ / heads and decode deadline;
5. publishes the request's `DecodeRecord` to Redis (stable or canary namespace) and
   to the Prometheus exporter.

Torch is used only through `Decoder`; the policy, store and telemetry parts are the
torch-free ops layer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specops.policies.rollout import effective_for, pick_revision
from specops.policies.schema import Policy, RequestClass
from specops.policies.state import EffectiveSettings
from specops.policies.turns import resolve_turn, turn_bucket

log = logging.getLogger(__name__)

#: fallback reasons recorded on requests that ran plainly because of the policy
REASON_FALLBACK = "policy_fallback"
REASON_OFF = "method_off"
REASON_TEMPERATURE = "temperature_out_of_range"
REASON_MISSING = "model_part_missing"


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
    stats: Any             # specops.decoder.stats.DecodeStats
    turn: int | None = None          # conversation turn used for classification (None: unknown)
    turn_label: str | None = None    # bounded telemetry label (1 / 2 / 3+) when the policy asks for it


class PolicyRuntime:
    """Serve requests with the settings the controller keeps in Redis (see module docstring).

    ``store``: a `PolicyStore` (revisions, rollout state) or None for a fixed ``policy``;
    ``watcher``: a `SettingsWatcher` over the same store, or None to use the policy's
    initial values; ``publisher`` / ``canary_publisher``: `RedisPublisher`s for the
    stable and canary telemetry namespaces; ``exporter``: a `PrometheusExporter`.
    """

    def __init__(self, decoder: Any, policy: Policy | None = None, *, store: Any = None, watcher: Any = None,
                 publisher: Any = None, canary_publisher: Any = None, exporter: Any = None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.time) -> None:
        if policy is None and store is None:
            raise ValueError("PolicyRuntime needs a policy or a policy store")
        self.decoder = decoder
        self.fixed_policy = policy
        self.store = store
        self.watcher = watcher
        self.publisher = publisher
        self.canary_publisher = canary_publisher
        self.exporter = exporter
        self.rng = rng or random.Random(0)
        self.clock = clock
        self._policies: dict[int, Policy] = {}
        self._turn_exporter: Any = None

    # -- which policy / settings serve a request ------------------------------------
    def _policy(self, revision: int | None) -> Policy:
        if revision is None or self.store is None:
            if self.fixed_policy is None:
                raise RuntimeError("the policy store has no current revision yet")
            return self.fixed_policy
        if revision not in self._policies:  # revisions are immutable: cache them
            self._policies[revision] = self.store.get_revision(revision).policy
        return self._policies[revision]

    def _route(self, routing_key: str) -> tuple[int | None, bool]:
        if self.store is None:
            return None, False
        stable = self.store.current_revision()
        if stable is None:
            return None, False
        chosen = pick_revision(self.store.rollout_state(), stable, routing_key)
        return chosen, chosen != stable

    def _settings(self, policy: Policy, rc: RequestClass, revision: int | None, canary: bool) -> EffectiveSettings:
        if not canary and self.watcher is not None:
            live = self.watcher.settings_for(rc.name)
            if live is not None:
                return live
        return effective_for(policy, revision or 0, self.clock())[rc.name]

    def _method(self, rc: RequestClass, s: EffectiveSettings, temperature: float) -> tuple[str, bool, str | None]:
        """(method to run, is a probe, fallback reason)."""
        if s.method == "off":
            return "ar", False, REASON_OFF
        if not rc.temperature.min <= temperature <= rc.temperature.max:
            return "ar", False, REASON_TEMPERATURE
        if s.method == "draft" and self.decoder.draft is None:
            return "ar", False, REASON_MISSING
        if s.method == "medusa" and self.decoder.medusa is None:
            return "ar", False, REASON_MISSING
        if s.fallback_active:
            if self.rng.random() < s.probe_fraction:
                return s.method, True, None
            return "ar", False, REASON_FALLBACK
        return s.method, False, None

    # -- serving -----------------------------------------------------------------------
    def serve(self, prompt: str | list[int], *, labels: dict[str, str] | None = None, routing_key: str | None = None,
              temperature: float = 0.0, max_new_tokens: int = 128, top_k: int | None = None,
              top_p: float | None = None, seed: int | None = None, eos_token_id: int | list[int] | None = None,
              turn: int | None = None) -> ServedRequest:
        """Decode one request under the policy and publish its telemetry.

        ``turn``: the conversation turn (`specops.policies.turns.turn_from_messages` for
        chat requests); None falls back to the ``turn`` label."""
        turn = resolve_turn(turn, labels)
        if isinstance(prompt, str):
            if self.decoder.tokenizer is None:
                raise ValueError("a text prompt needs the decoder's tokenizer; pass token ids instead")
            text, ids = prompt, self.decoder.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            text = self.decoder.tokenizer.decode(ids) if self.decoder.tokenizer is not None else ""
        if self.watcher is not None:
            self.watcher.poll()  # drains change notifications; re-reads on change or every reconcile_s
        revision, canary = self._route(routing_key if routing_key is not None else f"{self.rng.random():.12f}")
        policy = self._policy(revision)
        rc = policy.classify(text, labels or {}, len(ids), turn)
        settings = self._settings(policy, rc, revision, canary)
        method, probe, reason = self._method(rc, settings, temperature)
        kwargs: dict[str, Any] = {}
        if method in ("draft", "ngram"):
            kwargs["gamma"] = settings.gamma
        elif method == "medusa":
            kwargs["heads"] = min(settings.medusa_heads, self.decoder.medusa.config.num_heads)
            kwargs["tree"] = settings.tree_size  # upper bound on the tree's nodes; the runtime may plan fewer
        out = self.decoder.generate(ids, method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                                    deadline_s=rc.deadline_s, **kwargs)
        stats = out.stats
        if reason is not None and stats.fallback_reason is None:
            stats.fallback_reason = reason
        record = stats.to_record(rc.name)
        publisher = self.canary_publisher if canary else self.publisher
        if publisher is not None:
            publisher.publish(record)
        if self.exporter is not None:
            self.exporter.observe(record)
        label = None
        if policy.telemetry.turn_label:
            label = turn_bucket(turn)
            if self.exporter is not None and label is not None:
                if self._turn_exporter is None:
                    from specops.telemetry.turn_metrics import TurnExporter

                    self._turn_exporter = TurnExporter(self.exporter.registry)
                self._turn_exporter.observe(record, turn)
        return ServedRequest(tokens=list(out.tokens), request_class=rc.name, method=stats.method, revision=revision,
                             canary=canary, probe=probe, fallback_reason=stats.fallback_reason, stats=stats,
                             turn=turn, turn_label=label)
