"""Every Redis key name the policy store and the leader lease use, defined in one place.

``StoreKeys.for_namespace("specops")`` gives the names; the store's Lua scripts get
them as ``KEYS`` (never built inside a script). Every name starts with ``{namespace}:``,
a Redis Cluster hash tag (:mod:`specops.telemetry.keyspace`), so all of them share one
hash slot and the multi-key scripts run on a cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specops.telemetry.keyspace import key_prefix


def lease_epoch_key(lease_name: str) -> str:
    """The fencing-epoch counter that belongs to the lease ``lease_name``."""
    return f"{lease_name}:epoch"


@dataclass(frozen=True)
class StoreKeys:
    """Key names of one namespace (see ``specops.policies.store`` for what each holds)."""

    seq: str
    revisions: str
    current: str
    current_since: str
    current_log: str
    rolled_back: str
    canary: str
    effective: str
    rollout: str
    rollout_gen: str
    audit: str
    bandits: str
    lease: str
    epoch: str
    request_prefix: str
    channel: str

    @classmethod
    def for_namespace(cls, namespace: str, lease_name: str | None = None) -> StoreKeys:
        ns = key_prefix(namespace)          # "{namespace}": ValueError if empty, with spaces or braces
        lease = lease_name or f"{ns}:leader"
        return cls(seq=f"{ns}:rev:seq", revisions=f"{ns}:revisions", current=f"{ns}:current",
                   current_since=f"{ns}:current:since", current_log=f"{ns}:current:log",
                   rolled_back=f"{ns}:rolled-back", canary=f"{ns}:canary", effective=f"{ns}:effective",
                   rollout=f"{ns}:rollout", rollout_gen=f"{ns}:rollout:generation", audit=f"{ns}:audit",
                   bandits=f"{ns}:bandits", lease=lease, epoch=lease_epoch_key(lease),
                   request_prefix=f"{ns}:request:", channel=f"{ns}:effective:changed")

    def request(self, request_id: str) -> str:
        """Where the result of the write with ``request_id`` is remembered (idempotent retries)."""
        return self.request_prefix + request_id

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
