"""Which pool serves a request: the policy's class, its live settings, the pools.

The same classification and revision routing as ``specops serve``
(`Policy.classify` over text, labels and prompt length; `pick_revision` for the
canary), over the same fail-static `LivePolicy` (Redis down → the last known
settings). A class goes to the ``spec`` pool when its live method speculates,
and to the ``plain`` pool when the method is ``off``, the temperature is outside
the class's range, or the class is fallen back — except a ``probe_fraction`` share
of fallen-back traffic that keeps going to the ``spec`` pool so the controller sees
when speculation pays again.

With a single pool (both names pointing at one upstream) a fallback cannot be
enforced: it is reported (``enforceable`` False, ``fallback_reason`` still set on
the records, so alerts still fire) but the request goes to the only engine there is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from specops.policies.rollout import effective_for, pick_revision
from specops.policies.schema import CHARS_PER_TOKEN, Policy, Upstreams  # the proxy has no tokenizer
from specops.policies.state import EffectiveSettings
from specops.telemetry.records import GAMMA_METHODS

REASON_FALLBACK = "policy_fallback"
REASON_OFF = "method_off"
REASON_TEMPERATURE = "temperature_out_of_range"


@dataclass(frozen=True)
class Route:
    """Where one request goes, and why."""

    request_class: str
    pool: str                  # pool name (policy ``upstreams.spec`` / ``.plain``)
    method: str                # what the pool runs for it: draft | medusa | ngram | ar
    gamma: int
    revision: int | None
    canary: bool
    probe: bool
    fallback_reason: str | None
    enforced: bool             # False: wanted the plain pool but only one pool exists
    spec_pool: bool = False    # served by the speculative engine pool (its tokens/s is not the plain baseline)


class Router:
    """Resolve requests to pools from the last good policy state (never touches Redis)."""

    def __init__(self, policy: Policy, pools: dict[str, str], *, live=None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.fixed_policy = policy
        self.live = live
        self.pools = dict(pools)
        self.rng = rng or random.Random()
        self.clock = clock
        names = self.upstreams
        missing = [n for n in (names.spec, names.plain) if n not in self.pools]
        if missing and len(self.pools) != 1:
            raise ValueError(f"policy names pool(s) {', '.join(missing)} but the upstreams are "
                             f"{', '.join(sorted(self.pools))}")

    @property
    def upstreams(self) -> Upstreams:
        return self.policy().upstreams or Upstreams()

    @property
    def single(self) -> bool:
        """Only one engine pool: fallbacks are reported but not enforceable."""
        u = self.upstreams
        return len(self.pools) == 1 or self.pools.get(u.spec) == self.pools.get(u.plain)

    def pool_name(self, wanted: str) -> str:
        if wanted in self.pools:
            return wanted
        return next(iter(self.pools))

    def policy(self, revision: int | None = None) -> Policy:
        if self.live is not None:
            rev = revision if revision is not None else self.live.stable_revision
            if rev is not None:
                found = self.live.policy(rev)
                if found is not None:
                    return found
        return self.fixed_policy

    def _revision(self, key: str) -> tuple[int | None, bool]:
        if self.live is None or self.live.stable_revision is None:
            return None, False
        stable = self.live.stable_revision
        chosen = pick_revision(self.live.rollout, stable, key)
        if chosen != stable and self.live.policy(chosen) is None:
            return stable, False
        return chosen, chosen != stable

    def _settings(self, policy: Policy, name: str, revision: int | None, canary: bool) -> EffectiveSettings:
        if not canary and self.live is not None:
            live = self.live.settings_for(name)
            if live is not None:
                return live
        return effective_for(policy, revision or 0, self.clock())[name]

    def route(self, text: str, *, labels: dict[str, str] | None = None, routing_key: str | None = None,
              temperature: float = 1.0) -> Route:
        key = routing_key if routing_key is not None else f"{self.rng.random():.12f}"
        revision, canary = self._revision(key)
        policy = self.policy(revision)
        rc = policy.classify(text, labels or {}, len(text) // CHARS_PER_TOKEN, temperature=temperature)
        s = self._settings(policy, rc.name, revision, canary)
        u = policy.upstreams or Upstreams()
        reason: str | None = None
        probe = False
        if s.method == "off":
            reason = REASON_OFF
        elif not rc.temperature.min <= temperature <= rc.temperature.max:
            reason = REASON_TEMPERATURE
        elif s.fallback_active:
            if self.rng.random() < s.probe_fraction:
                probe = True
            else:
                reason = REASON_FALLBACK
        wanted = u.plain if reason else u.spec
        pool = self.pool_name(wanted)
        enforced = not (reason and self.single)
        method = "ar" if (reason and enforced) else (s.method if s.method != "off" else "ar")
        gamma = s.gamma if method in GAMMA_METHODS else 0
        spec_pool = method != "ar" and (pool == self.pool_name(u.spec) or self.single)
        return Route(rc.name, pool, method, gamma, revision, canary, probe, reason, enforced, spec_pool)

    def with_pool(self, route: Route, pool: str) -> Route:
        """``route`` after a failover to ``pool`` (the plain pool decodes plainly)."""
        spec_pool = route.method != "ar" and (pool == self.pool_name(self.upstreams.spec) or self.single)
        return replace(route, pool=pool, spec_pool=spec_pool)

    def failover_pool(self, pool: str) -> str | None:
        """The other pool, when the policy allows failing over to it."""
        u = self.upstreams
        if not u.failover or self.single:
            return None
        other = u.plain if pool == u.spec else u.spec
        return other if other in self.pools and self.pools[other] != self.pools[pool] else None
