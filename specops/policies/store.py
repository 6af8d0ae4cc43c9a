"""Policy state in Redis: revisions, effective settings, rollout state, audit stream.

Every write is one Lua script, so it is atomic, and every write may carry the
fencing epoch of the controller's leader lease (``specops.controller.leader``):
the script compares it with the lease's epoch key first and changes nothing if it
is stale (:class:`StaleEpochError`). Writes without an epoch are operator actions
(the CLI); they are still atomic, and rollout-state writes can compare-and-set on
the state's ``generation``.

Keys (``ns`` = namespace)::

    ns:rev:seq           INCR counter of revision numbers
    ns:revisions         HASH revision -> {"text", "created_at", "version"}
    ns:current           revision the stable traffic uses
    ns:current:log       LIST of revisions made current, newest first (rollback targets)
    ns:canary            revision under rollout (absent when none)
    ns:effective         HASH class -> EffectiveSettings JSON; PUBLISH on ns:effective:changed
    ns:rollout           RolloutState JSON;  ns:rollout:generation  its CAS counter
    ns:audit             STREAM of every decision with its inputs (XADD MAXLEN ~)
    <lease>:epoch        fencing epoch, owned by LeaderLease (lease name: ns:leader)
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from specops.policies.errors import ConflictError, StaleEpochError, StateError, StoreUnavailableError
from specops.policies.loader import parse_policy
from specops.policies.schema import Policy
from specops.policies.state import EffectiveSettings, RolloutState

log = logging.getLogger(__name__)

AUDIT_MAXLEN = 10_000

# Shared prelude: reject a stale (or unknown future) fencing epoch before any write.
_FENCE = """
local epoch = ARGV[1]
if epoch ~= '' then
  local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
  if tonumber(epoch) ~= cur then
    return redis.error_reply('STALE_EPOCH ' .. cur)
  end
end
"""

# KEYS: epoch, seq, revisions, audit   ARGV: epoch, blob, audit-event, maxlen, now
_PUT_REVISION = _FENCE + """
local rev = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], tostring(rev), ARGV[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'event', ARGV[3], 'revision', tostring(rev))
return rev
"""

# KEYS: epoch, revisions, current, canary, effective, rollout, rollout-gen, audit, current-log
# ARGV: epoch, envelope JSON, channel, maxlen
_COMMIT = _FENCE + """
local env = cjson.decode(ARGV[2])
local gen = tonumber(redis.call('GET', KEYS[7]) or '0')
if env['expect_generation'] ~= nil and tonumber(env['expect_generation']) ~= gen then
  return redis.error_reply('CONFLICT ' .. gen)
end
for _, field in ipairs({'current', 'canary'}) do
  local rev = env[field]
  if rev ~= nil and tonumber(rev) > 0 and redis.call('HEXISTS', KEYS[2], tostring(rev)) == 0 then
    return redis.error_reply('NO_REVISION ' .. tostring(rev))
  end
end
if env['current'] ~= nil then
  local rev = tostring(env['current'])
  if redis.call('GET', KEYS[3]) ~= rev then
    redis.call('SET', KEYS[3], rev)
    redis.call('LPUSH', KEYS[9], rev)
    redis.call('LTRIM', KEYS[9], 0, 999)
  end
end
if env['canary'] ~= nil then
  if tonumber(env['canary']) > 0 then
    redis.call('SET', KEYS[4], tostring(env['canary']))
  else
    redis.call('DEL', KEYS[4])
  end
end
if env['effective'] ~= nil then
  if env['effective_replace'] then
    redis.call('DEL', KEYS[5])
  end
  local n = 0
  for cls, blob in pairs(env['effective']) do
    redis.call('HSET', KEYS[5], cls, blob)
    n = n + 1
  end
  if env['publish'] ~= nil then
    redis.call('PUBLISH', ARGV[3], env['publish'])
  end
end
if env['rollout'] ~= nil then
  redis.call('SET', KEYS[6], env['rollout'])
  gen = redis.call('INCR', KEYS[7])
end
if env['audit'] ~= nil then
  redis.call('XADD', KEYS[8], 'MAXLEN', '~', ARGV[4], '*', 'event', env['audit'])
end
return gen
"""


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
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"invalid namespace {namespace!r}")
        self.redis = redis_client
        self.namespace = namespace
        self.clock = clock
        self.audit_maxlen = audit_maxlen
        ns = namespace
        self.lease_name = lease_name or f"{ns}:leader"
        self.keys = {
            "epoch": f"{self.lease_name}:epoch", "seq": f"{ns}:rev:seq", "revisions": f"{ns}:revisions",
            "current": f"{ns}:current", "canary": f"{ns}:canary", "effective": f"{ns}:effective",
            "rollout": f"{ns}:rollout", "rollout_gen": f"{ns}:rollout:generation", "audit": f"{ns}:audit",
            "current_log": f"{ns}:current:log",
        }
        self.channel = f"{ns}:effective:changed"
        self._put = redis_client.register_script(_PUT_REVISION)
        self._commit = redis_client.register_script(_COMMIT)
        self._policy_cache: dict[int, StoredRevision] = {}

    # ----------------------------------------------------------------- revisions
    def put_revision(self, policy: Policy, text: str, *, epoch: int | None = None, actor: str = "operator") -> int:
        """Store a new revision (``text`` must be the YAML ``policy`` was loaded from); returns its number.

        The text is validated again here, so nothing invalid is ever stored.
        """
        reparsed = parse_policy(text, "<revision>")
        if reparsed != policy:
            raise ValueError("put_revision: the policy object does not match its YAML text")
        now = self.clock()
        blob = json.dumps({"text": text, "created_at": now, "version": policy.version})
        event = self._event("revision.created", actor, epoch, now, {"version": policy.version})
        k = self.keys
        rev = self._run(self._put, [k["epoch"], k["seq"], k["revisions"], k["audit"]],
                        [self._epoch_arg(epoch), blob, event, self.audit_maxlen])
        log.info("stored policy revision %s (version %s)", rev, policy.version)
        return int(rev)

    def get_revision(self, n: int) -> StoredRevision:
        if n in self._policy_cache:
            return self._policy_cache[n]
        raw = self._call(self.redis.hget, self.keys["revisions"], str(n))
        if raw is None:
            raise StateError(f"no policy revision {n}")
        data = json.loads(raw)
        stored = StoredRevision(n, parse_policy(data["text"], f"<revision {n}>"), data["text"], float(data["created_at"]))
        self._policy_cache[n] = stored
        return stored

    def history(self) -> list[StoredRevision]:
        """All stored revisions, oldest first."""
        numbers = sorted(int(_str(k)) for k in self._call(self.redis.hkeys, self.keys["revisions"]))
        return [self.get_revision(n) for n in numbers]

    def current_revision(self) -> int | None:
        raw = self._call(self.redis.get, self.keys["current"])
        return int(raw) if raw is not None else None

    def canary_revision(self) -> int | None:
        raw = self._call(self.redis.get, self.keys["canary"])
        return int(raw) if raw is not None else None

    def previous_current(self) -> int | None:
        """The revision that was current before the present one (default rollback target)."""
        current = self.current_revision()
        for raw in self._call(self.redis.lrange, self.keys["current_log"], 0, -1):
            rev = int(raw)
            if rev != current:
                return rev
        return None

    def current_policy(self) -> Policy | None:
        rev = self.current_revision()
        return None if rev is None else self.get_revision(rev).policy

    # ----------------------------------------------------------------- effective settings
    def effective(self) -> dict[str, EffectiveSettings]:
        raw = self._call(self.redis.hgetall, self.keys["effective"])
        return {_str(k): EffectiveSettings.from_json(v) for k, v in sorted(raw.items())}

    def set_effective(self, settings: dict[str, EffectiveSettings], *, epoch: int | None, reason: str,
                      replace: bool = False, inputs: dict[str, Any] | None = None, actor: str = "controller") -> None:
        """Write per-class settings (merged, or replacing all with ``replace``) and PUBLISH the change."""
        for name, s in settings.items():
            if name != s.request_class:
                raise ValueError(f"settings for class {s.request_class!r} filed under {name!r}")
        self.commit(epoch=epoch, effective=settings, effective_replace=replace, actor=actor,
                    audit=("effective.set", {"reason": reason, "classes": sorted(settings), "inputs": inputs or {},
                                             "settings": {k: json.loads(v.to_json()) for k, v in settings.items()}}))

    # ----------------------------------------------------------------- rollout state
    def rollout_state(self) -> RolloutState | None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(self.keys["rollout"])
        pipe.get(self.keys["rollout_gen"])
        raw, gen = self._call(pipe.execute)
        if raw is None:
            return None
        return RolloutState.from_json(raw, generation=int(gen or 0))

    def set_rollout_state(self, state: RolloutState, *, epoch: int | None, expect_generation: int | None = None,
                          reason: str = "", actor: str = "controller") -> int:
        """Write the rollout state; with ``expect_generation``, only if nobody wrote since. Returns the new generation."""
        return self.commit(epoch=epoch, rollout=state, expect_generation=expect_generation, actor=actor,
                           audit=("rollout.state", {"reason": reason, "phase": state.phase, "revision": state.revision,
                                                    "step_index": state.step_index, "weight": state.weight}))

    # ----------------------------------------------------------------- audit
    def append_audit(self, event: dict[str, Any], *, epoch: int | None, actor: str = "controller") -> str:
        """Append one decision (with its inputs) to the audit stream; returns the stream entry id."""
        kind = str(event.get("kind", "decision"))
        self.commit(epoch=epoch, audit=(kind, {k: v for k, v in event.items() if k != "kind"}), actor=actor)
        last = self._call(self.redis.xrevrange, self.keys["audit"], count=1)
        return _str(last[0][0]) if last else ""

    def read_audit(self, count: int = 100) -> list[dict[str, Any]]:
        """The newest ``count`` audit events, oldest first."""
        entries = self._call(self.redis.xrevrange, self.keys["audit"], count=count)
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
    def commit(self, *, epoch: int | None, actor: str, audit: tuple[str, dict[str, Any]] | None = None,
               rollout: RolloutState | None = None, expect_generation: int | None = None,
               current: int | None = None, canary: int | None = None, clear_canary: bool = False,
               effective: dict[str, EffectiveSettings] | None = None, effective_replace: bool = False) -> int:
        """Apply several changes in one fenced, atomic step; returns the rollout generation after it."""
        now = self.clock()
        env: dict[str, Any] = {}
        if expect_generation is not None:
            env["expect_generation"] = int(expect_generation)
        if rollout is not None:
            env["rollout"] = rollout.to_json()
        if current is not None:
            env["current"] = int(current)
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
        if audit is not None:
            kind, data = audit
            env["audit"] = self._event(kind, actor, epoch, now, data)
        k = self.keys
        keys = [k["epoch"], k["revisions"], k["current"], k["canary"], k["effective"], k["rollout"], k["rollout_gen"],
                k["audit"], k["current_log"]]
        gen = self._run(self._commit, keys, [self._epoch_arg(epoch), json.dumps(env), self.channel, self.audit_maxlen])
        return int(gen)

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _epoch_arg(epoch: int | None) -> str:
        if epoch is None:
            return ""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"fencing epoch must be a non-negative int, got {epoch!r}")
        return str(epoch)

    @staticmethod
    def _event(kind: str, actor: str, epoch: int | None, now: float, data: dict[str, Any]) -> str:
        return json.dumps({"kind": kind, "actor": actor, "epoch": epoch, "at": now, **data}, sort_keys=True, default=str)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._call(script, keys=keys, args=args)
        except redis.ResponseError as exc:
            msg = str(exc)
            if msg.startswith("STALE_EPOCH"):
                current = int(msg.split()[1])
                epoch = int(args[0]) if args[0] != "" else -1
                raise StaleEpochError(epoch, current) from None
            if msg.startswith("CONFLICT"):
                raise ConflictError(f"rollout state changed concurrently (now at generation {msg.split()[1]}); retry") from None
            if msg.startswith("NO_REVISION"):
                raise StateError(f"no policy revision {msg.split()[1]}") from None
            raise

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(f"Redis unavailable: {exc}", retry_after_s=1.0) from exc
