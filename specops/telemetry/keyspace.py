"""Key names in Redis: every key of one namespace carries one hash tag, so one hash slot.

Redis Cluster runs a multi-key Lua script or MULTI/EXEC only when all its keys hash to
one slot, and a key containing ``{tag}`` hashes to the slot of ``tag``. So every key
specops writes for namespace ``ns`` starts with ``{ns}:`` — the policy state
(``{ns}:current``, ``{ns}:rollout``, the audit stream, the leader lease and its fencing
epoch) and the telemetry buckets (``{ns}:tm:…``) alike. One namespace therefore lives
on one cluster shard; standalone Redis and Sentinel ignore the braces.

Versions before this layout used the bare prefix (``specops:current``);
:data:`LEGACY_STATE_SUFFIXES` names the durable state keys that
:func:`migrate_legacy_keys` renames (telemetry buckets expire on their own).
"""

from __future__ import annotations

from typing import Any

# The durable state under a namespace (telemetry buckets and the lease itself expire).
# (Request-id records, ``ns:request:<id>``, expire after an hour and are not migrated.)
LEGACY_STATE_SUFFIXES = ("rev:seq", "revisions", "current", "current:since", "current:log", "rolled-back", "canary",
                         "effective", "rollout", "rollout:generation", "audit", "bandits", "leader:epoch")


def key_prefix(namespace: str) -> str:
    """``{namespace}``: the prefix (and Redis Cluster hash tag) of every key of ``namespace``."""
    if not namespace or any(c.isspace() or c in "{}" for c in namespace):
        raise ValueError(f"invalid namespace {namespace!r}: non-empty, without spaces or braces")
    return "{" + namespace + "}"


def migrate_legacy_keys(client: Any, namespace: str) -> list[tuple[str, str]]:
    """Rename the pre-hash-tag state keys of ``namespace`` (``ns:current`` -> ``{ns}:current``).

    For one Redis server (standalone or Sentinel-managed; a cluster never held the old
    layout, whose scripts it refuses). Run it with every controller of the namespace
    stopped. A key whose new name already exists is left alone and reported as a
    ``ValueError`` before anything is renamed. Returns the ``(old, new)`` pairs renamed.
    """
    prefix = key_prefix(namespace)
    pairs = [(f"{namespace}:{s}", f"{prefix}:{s}") for s in LEGACY_STATE_SUFFIXES]
    present = [(old, new) for old, new in pairs if client.exists(old)]
    clashes = [new for _, new in present if client.exists(new)]
    if clashes:
        raise ValueError(f"both layouts hold state for namespace {namespace!r} ({', '.join(clashes)}); "
                         "nothing renamed")
    if present:
        pipe = client.pipeline(transaction=True)          # all renamed, or none
        for old, new in present:
            pipe.rename(old, new)
        pipe.execute()
    return present
