"""Policy state in Redis: revisions, effective settings, rollout state, audit stream.

Every write is one Lua script, so it is atomic, and every write may carry the
fence of the controller's leader lease (``specops.controller.leader``): a
:class:`Fence` (epoch and lease token) or a bare epoch. The script checks the
epoch against the lease's epoch key and, for a :class:`Fence`, that the lease key
still holds the writer's token; otherwise it changes nothing
(:class:`StaleEpochError` / :class:`LeaseLostError`). The token check is what keeps
a paused old leader out after Redis lost its data and handed a new leader the same
epoch. Writes without a fence are operator actions (the CLI); they are still
atomic, and can compare-and-set on the rollout state's ``generation``, on the
current revision (``expect_current``: a rollback applies once) and on the
effective settings a tick read (``expect_effective``).

Every write carries a request id. The script remembers the result under
``ns:request:<id>`` for an hour, so redis-py re-sending a script after a timeout
(the first attempt may have run) returns the first result instead of storing a
revision twice or reporting a conflict with itself.

Keys (``ns`` = ``{namespace}``, a Redis Cluster hash tag: every key of a namespace lands in
one hash slot; names come from :class:`~specops.policies.keys.StoreKeys`)::

    ns:rev:seq           INCR counter of revision numbers
    ns:revisions         HASH revision -> {"text", "created_at", "version"}
    ns:current           revision the stable traffic uses; ns:current:since  when it became current
    ns:current:log       LIST of revisions made current, newest first (rollback targets)
    ns:rolled-back       SET of revisions rolled back from (never picked as an automatic rollback target)
    ns:canary            revision under rollout (absent when none)
    ns:effective         HASH class -> EffectiveSettings JSON; PUBLISH on ns:effective:changed
    ns:bandits           HASH class -> bandit arm statistics JSON (the controller's, kept across failover)
    ns:rollout           RolloutState JSON;  ns:rollout:generation  its CAS counter
    ns:audit             STREAM of every decision with its inputs (XADD MAXLEN ~)
    ns:request:<id>      result of an applied write (idempotent retries), expires
    <lease>, <lease>:epoch   leader lease token and fencing epoch, owned by LeaderLease (lease: ns:leader)
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from specops.policies.errors import (
    ConflictError,
    CurrentChangedError,
    LeaseLostError,
    StaleEpochError,
    StateError,
    StoreUnavailableError,
)
from specops.policies.keys import StoreKeys
from specops.policies.loader import parse_policy
from specops.policies.schema import Policy
from specops.policies.state import EffectiveSettings, RolloutState

log = logging.getLogger(__name__)

AUDIT_MAXLEN = 10_000
REQUEST_TTL_S = 3600


@dataclass(frozen=True)
class Fence:
    """What a leader's write carries: the lease's epoch and the holder's token."""

    epoch: int
    token: str

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"fencing epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("a fence needs the lease holder's token")


# Shared prelude. KEYS[1] epoch, KEYS[2] lease, KEYS[3] request; ARGV[1] epoch, ARGV[2] token, ARGV[3] request TTL.
# A request id already applied returns its first result (a retried script); then the fence.
_FENCE = """
local done = redis.call('GET', KEYS[3])
if done then
  return tonumber(done)
end
local epoch = ARGV[1]
if epoch ~= '' then
  local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tonumber(epoch) ~= cur then
    return redis.error_reply('STALE_EPOCH ' .. cur)
  end
  if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2] then
    return redis.error_reply('NOT_HOLDER ' .. cur)
  end
end
"""

_REMEMBER = """
redis.call('SET', KEYS[3], tostring(result), 'EX', tonumber(ARGV[3]))
return result
"""

# KEYS: +4 seq, 5 revisions, 6 audit   ARGV: +4 blob, 5 audit-event, 6 maxlen
_PUT_REVISION = _FENCE + """
local result = redis.call('INCR', KEYS[4])
redis.call('HSET', KEYS[5], tostring(result), ARGV[4])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[6], '*', 'event', ARGV[5], 'revision', tostring(result))
""" + _REMEMBER

# KEYS: +4 revisions, 5 current, 6 canary, 7 effective, 8 rollout, 9 rollout-gen, 10 audit, 11 current-log,
#       12 current-since, 13 rolled-back, 14 bandits
# ARGV: +4 envelope JSON, 5 channel, 6 maxlen
_COMMIT = _FENCE + """
local env = cjson.decode(ARGV[4])
local gen = tonumber(redis.call('GET', KEYS[9]) or '0')
if env['expect_generation'] ~= nil and tonumber(env['expect_generation']) ~= gen then
  return redis.error_reply('CONFLICT ' .. gen)
end
if env['expect_current'] ~= nil then
  local cur = redis.call('GET', KEYS[5])
  if cur ~= tostring(env['expect_current']) then
    return redis.error_reply('CURRENT_CHANGED ' .. tostring(env['expect_current']) .. ' ' .. (cur or 'none'))
  end
end
if env['expect_effective'] ~= nil then
  for cls, blob in pairs(env['expect_effective']) do
    if (redis.call('HGET', KEYS[7], cls) or '') ~= blob then
      return redis.error_reply('EFFECTIVE_CHANGED ' .. cls)
    end
  end
end
for _, field in ipairs({'current', 'canary'}) do
  local rev = env[field]
  if rev ~= nil and tonumber(rev) > 0 and redis.call('HEXISTS', KEYS[4], tostring(rev)) == 0 then
    return redis.error_reply('NO_REVISION ' .. tostring(rev))
  end
end
if env['current'] ~= nil then
  local rev = tostring(env['current'])
  local old = redis.call('GET', KEYS[5])
  if old ~= rev then
    if env['rollback'] and old then
      redis.call('SADD', KEYS[13], old)
    end
    redis.call('SET', KEYS[5], rev)
    redis.call('SET', KEYS[12], tostring(env['now']))
    redis.call('SREM', KEYS[13], rev)
    redis.call('LPUSH', KEYS[11], rev)
    redis.call('LTRIM', KEYS[11], 0, 999)
  end
end
if env['canary'] ~= nil then
  if tonumber(env['canary']) > 0 then
    redis.call('SET', KEYS[6], tostring(env['canary']))
  else
    redis.call('DEL', KEYS[6])
  end
end
if env['effective'] ~= nil then
  if env['effective_replace'] then
    redis.call('DEL', KEYS[7])
  end
  for cls, blob in pairs(env['effective']) do
    redis.call('HSET', KEYS[7], cls, blob)
  end
  if env['publish'] ~= nil then
    redis.call('PUBLISH', ARGV[5], env['publish'])
  end
end
if env['bandits'] ~= nil then
  if env['bandits_replace'] then
    redis.call('DEL', KEYS[14])
  end
  for cls, blob in pairs(env['bandits']) do
    redis.call('HSET', KEYS[14], cls, blob)
  end
end
if env['rollout'] ~= nil then
  redis.call('SET', KEYS[8], env['rollout'])
  gen = redis.call('INCR', KEYS[9])
end
if env['audit'] ~= nil then
  for _, event in ipairs(env['audit']) do
    redis.call('XADD', KEYS[10], 'MAXLEN', '~', ARGV[6], '*', 'event', event)
  end
end
local result = gen
""" + _REMEMBER


@dataclass(frozen=True)
class StoredRevision:
    """One stored policy revision (always a policy that validated)."""

    revision: int
    policy: Policy
    text: str
    created_at: float


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class PolicyStore:
    """Policy state in one Redis, under ``namespace``; see the module docstring for keys."""

    def __init__(self, redis_client: redis.Redis, namespace: str = "specops", clock: Callable[[], float] = time.time,
                 *, lease_name: str | None = None, audit_maxlen: int = AUDIT_MAXLEN):
        self.names = StoreKeys.for_namespace(namespace, lease_name)
        self.redis = redis_client
        self.namespace = namespace
        self.clock = clock
        self.audit_maxlen = audit_maxlen
        self.lease_name = self.names.lease
        self.keys = self.names.as_dict()
        self.channel = self.names.channel
        self._put = redis_client.register_script(_PUT_REVISION)
        self._commit = redis_client.register_script(_COMMIT)
        self._policy_cache: dict[int, StoredRevision] = {}

    # ----------------------------------------------------------------- revisions
    def put_revision(self, policy: Policy, text: str, *, epoch: int | Fence | None = None, actor: str = "operator",
                     request_id: str | None = None) -> int:
        """Store a new revision (``text`` must be the YAML ``policy`` was loaded from); returns its number.

        The text is validated again here, so nothing invalid is ever stored. A retry
        with the same ``request_id`` returns the first number and stores nothing.
        """
        reparsed = parse_policy(text, "<revision>")
        if reparsed != policy:
            raise ValueError("put_revision: the policy object does not match its YAML text")
        now = self.clock()
        blob = json.dumps({"text": text, "created_at": now, "version": policy.version})
        event = self._event("revision.created", actor, epoch, now, {"version": policy.version})
        k = self.names
        rev = self._run(self._put, [k.seq, k.revisions, k.audit],
                        [blob, event, self.audit_maxlen], epoch, request_id)
        log.info("stored policy revision %s (version %s)", rev, policy.version)
        return int(rev)

    def get_revision(self, n: int) -> StoredRevision:
        if n in self._policy_cache:
            return self._policy_cache[n]
        raw = self._call(self.redis.hget, self.names.revisions, str(n))
        if raw is None:
            raise StateError(f"no policy revision {n}")
        data = json.loads(raw)
        stored = StoredRevision(n, parse_policy(data["text"], f"<revision {n}>"), data["text"], float(data["created_at"]))
        self._policy_cache[n] = stored
        return stored

    def history(self) -> list[StoredRevision]:
        """All stored revisions, oldest first."""
        numbers = sorted(int(_str(k)) for k in self._call(self.redis.hkeys, self.names.revisions))
        return [self.get_revision(n) for n in numbers]

    def current_revision(self) -> int | None:
        raw = self._call(self.redis.get, self.names.current)
        return int(raw) if raw is not None else None

    def current_since(self) -> float | None:
        """``clock()`` when the current revision was made current (None if unknown)."""
        raw = self._call(self.redis.get, self.names.current_since)
        return float(raw) if raw is not None else None

    def canary_revision(self) -> int | None:
        raw = self._call(self.redis.get, self.names.canary)
        return int(raw) if raw is not None else None

    def rolled_back_revisions(self) -> set[int]:
        """Revisions that were rolled back from (and not made current again since)."""
        return {int(_str(r)) for r in self._call(self.redis.smembers, self.names.rolled_back)}

    def previous_current(self, *, skip_rolled_back: bool = False) -> int | None:
        """The revision that was current before the present one (default rollback target).

        With ``skip_rolled_back``, revisions that were themselves rolled back from are
        passed over: an automatic rollback never returns to a revision judged bad.
        """
        current = self.current_revision()
        bad = self.rolled_back_revisions() if skip_rolled_back else set()
        for raw in self._call(self.redis.lrange, self.names.current_log, 0, -1):
            rev = int(raw)
            if rev != current and rev not in bad:
                return rev
        return None

    def current_policy(self) -> Policy | None:
        rev = self.current_revision()
        return None if rev is None else self.get_revision(rev).policy

    # ----------------------------------------------------------------- effective settings
    def effective(self) -> dict[str, EffectiveSettings]:
        raw = self._call(self.redis.hgetall, self.names.effective)
        return {_str(k): EffectiveSettings.from_json(v) for k, v in sorted(raw.items())}

    def set_effective(self, settings: dict[str, EffectiveSettings], *, epoch: int | Fence | None, reason: str,
                      replace: bool = False, inputs: dict[str, Any] | None = None, actor: str = "controller",
                      expect: dict[str, EffectiveSettings | None] | None = None,
                      bandits: dict[str, dict[str, Any]] | None = None) -> None:
        """Write per-class settings (merged, or replacing all with ``replace``) and PUBLISH the change.

        ``expect`` (class -> the settings the caller read, None for absent) makes the
        write a compare-and-set: if any of them changed meanwhile (an operator's
        rollback between a tick's read and its write) nothing is written and
        :class:`ConflictError` is raised. ``bandits`` (class -> arm statistics) are
        written in the same step.
        """
        for name, s in settings.items():
            if name != s.request_class:
                raise ValueError(f"settings for class {s.request_class!r} filed under {name!r}")
        self.commit(epoch=epoch, effective=settings, effective_replace=replace, actor=actor,
                    expect_effective=expect, bandits=bandits,
                    audit=("effective.set", {"reason": reason, "classes": sorted(settings), "inputs": inputs or {},
                                             "settings": {k: json.loads(v.to_json()) for k, v in settings.items()}}))

    def bandit_stats(self) -> dict[str, dict[str, Any]]:
        """The controller's bandit arm statistics per class (see ``specops.controller.adapt.BanditState``)."""
        raw = self._call(self.redis.hgetall, self.names.bandits)
        return {_str(k): json.loads(v) for k, v in raw.items()}

    # ----------------------------------------------------------------- runtimes' view
    def live_view(self) -> tuple[int | None, RolloutState | None, dict[str, EffectiveSettings]]:
        """(current revision, rollout state, per-class settings), read in one transaction: what a
        runtime's `specops.policies.live.LivePolicy` refreshes. Raises what the client raises (the
        runtime's own backoff handles it, without this store's retries)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(self.names.current)
        pipe.get(self.names.rollout)
        pipe.get(self.names.rollout_gen)
        pipe.hgetall(self.names.effective)
        current, rollout_raw, gen, eff_raw = pipe.execute()
        stable = int(current) if current is not None else None
        rollout = RolloutState.from_json(rollout_raw, generation=int(gen or 0)) if rollout_raw is not None else None
        return stable, rollout, {_str(k): EffectiveSettings.from_json(v) for k, v in eff_raw.items()}

    def subscribe(self) -> Any:
        """A pubsub connection subscribed to this store's change notifications."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.channel)
        return pubsub

    # ----------------------------------------------------------------- rollout state
    def rollout_state(self) -> RolloutState | None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(self.names.rollout)
        pipe.get(self.names.rollout_gen)
        raw, gen = self._call(pipe.execute)
        if raw is None:
            return None
        return RolloutState.from_json(raw, generation=int(gen or 0))

    def set_rollout_state(self, state: RolloutState, *, epoch: int | Fence | None,
                          expect_generation: int | None = None, reason: str = "", actor: str = "controller") -> int:
        """Write the rollout state; with ``expect_generation``, only if nobody wrote since. Returns the new generation."""
        return self.commit(epoch=epoch, rollout=state, expect_generation=expect_generation, actor=actor,
                           audit=("rollout.state", {"reason": reason, "phase": state.phase, "revision": state.revision,
                                                    "step_index": state.step_index, "weight": state.weight}))

    # ----------------------------------------------------------------- audit
    def append_audit(self, event: dict[str, Any], *, epoch: int | Fence | None, actor: str = "controller") -> str:
        """Append one decision (with its inputs) to the audit stream; returns the stream entry id."""
        kind = str(event.get("kind", "decision"))
        self.commit(epoch=epoch, audit=(kind, {k: v for k, v in event.items() if k != "kind"}), actor=actor)
        last = self._call(self.redis.xrevrange, self.names.audit, count=1)
        return _str(last[0][0]) if last else ""

    def read_audit(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest ``count`` audit events, oldest first."""
        entries = self._call(self.redis.xrevrange, self.names.audit, count=count)
        out = []
        for entry_id, fields_ in reversed(entries):
            fields_ = {_str(k): _str(v) for k, v in fields_.items()}
            event = json.loads(fields_["event"])
            if "revision" in fields_:
                event["revision"] = int(fields_["revision"])
            event["id"] = _str(entry_id)
            out.append(event)
        return out

    # ----------------------------------------------------------------- the atomic write
    def commit(self, *, epoch: int | Fence | None, actor: str,
               audit: tuple[str, dict[str, Any]] | list[tuple[str, dict[str, Any]]] | None = None,
               rollout: RolloutState | None = None, expect_generation: int | None = None,
               current: int | None = None, canary: int | None = None, clear_canary: bool = False,
               effective: dict[str, EffectiveSettings] | None = None, effective_replace: bool = False,
               expect_current: int | None = None, expect_effective: dict[str, EffectiveSettings | None] | None = None,
               rollback: bool = False, bandits: dict[str, dict[str, Any]] | None = None,
               bandits_replace: bool = False, request_id: str | None = None) -> int:
        """Apply several changes in one fenced, atomic step; returns the rollout generation after it.

        ``expect_current``: only if that revision is current (:class:`CurrentChangedError`
        otherwise). ``rollback``: the revision ``current`` replaces is marked rolled back
        from. ``request_id``: see the module docstring (a fresh one by default).
        """
        now = self.clock()
        env: dict[str, Any] = {"now": now}
        if expect_generation is not None:
            env["expect_generation"] = int(expect_generation)
        if expect_current is not None:
            env["expect_current"] = int(expect_current)
        if expect_effective:
            env["expect_effective"] = {name: s.to_json() if s is not None else ""
                                       for name, s in expect_effective.items()}
        if rollout is not None:
            env["rollout"] = rollout.to_json()
        if current is not None:
            env["current"] = int(current)
            env["rollback"] = bool(rollback)
        if clear_canary:
            env["canary"] = 0
        elif canary is not None:
            env["canary"] = int(canary)
        if effective is not None:
            if not effective and not effective_replace:
                raise ValueError("empty effective settings")
            env["effective"] = {name: s.to_json() for name, s in effective.items()}
            env["effective_replace"] = bool(effective_replace)
            env["publish"] = json.dumps({"classes": sorted(effective), "at": now, "replace": effective_replace})
        if bandits is not None or bandits_replace:
            env["bandits"] = {name: json.dumps(b, sort_keys=True) for name, b in (bandits or {}).items()}
            env["bandits_replace"] = bool(bandits_replace)
        if audit is not None:
            events = [audit] if isinstance(audit, tuple) else list(audit)
            if events:
                env["audit"] = [self._event(kind, actor, epoch, now, data) for kind, data in events]
        k = self.names
        keys = [k.revisions, k.current, k.canary, k.effective, k.rollout, k.rollout_gen, k.audit, k.current_log,
                k.current_since, k.rolled_back, k.bandits]
        gen = self._run(self._commit, keys, [json.dumps(env), self.channel, self.audit_maxlen], epoch, request_id)
        return int(gen)

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _fence_args(epoch: int | Fence | None) -> tuple[str, str]:
        if epoch is None:
            return "", ""
        if isinstance(epoch, Fence):
            return str(epoch.epoch), epoch.token
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"fencing epoch must be a non-negative int or a Fence, got {epoch!r}")
        return str(epoch), ""

    @staticmethod
    def _event(kind: str, actor: str, epoch: int | Fence | None, now: float, data: dict[str, Any]) -> str:
        number = epoch.epoch if isinstance(epoch, Fence) else epoch
        return json.dumps({"kind": kind, "actor": actor, "epoch": number, "at": now, **data}, sort_keys=True, default=str)

    def _run(self, script: Any, keys: list[str], args: list[Any], epoch: int | Fence | None,
             request_id: str | None) -> Any:
        epoch_arg, token = self._fence_args(epoch)
        rid = request_id or uuid.uuid4().hex
        if not isinstance(rid, str) or not rid or any(c.isspace() for c in rid):
            raise ValueError(f"request_id must be a non-empty string without spaces, got {request_id!r}")
        k = self.names
        try:
            return self._call(script, keys=[k.epoch, k.lease, k.request(rid), *keys],
                              args=[epoch_arg, token, REQUEST_TTL_S, *args])
        except redis.ResponseError as exc:
            msg = str(exc)
            words = msg.split()
            mine = int(epoch_arg) if epoch_arg else -1
            if msg.startswith("STALE_EPOCH"):
                raise StaleEpochError(mine, int(words[1])) from None
            if msg.startswith("NOT_HOLDER"):
                raise LeaseLostError(mine, int(words[1])) from None
            if msg.startswith("CONFLICT"):
                raise ConflictError(f"rollout state changed concurrently (now at generation {words[1]}); retry") from None
            if msg.startswith("CURRENT_CHANGED"):
                raise CurrentChangedError(int(words[1]), None if words[2] == "none" else int(words[2])) from None
            if msg.startswith("EFFECTIVE_CHANGED"):
                raise ConflictError(f"effective settings of class {words[1]} changed concurrently; retry") from None
            if msg.startswith("NO_REVISION"):
                raise StateError(f"no policy revision {words[1]}") from None
            raise

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(f"Redis unavailable: {exc}", retry_after_s=1.0) from exc
