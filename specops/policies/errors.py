"""Errors raised for invalid policies and for the policy state in Redis.

A policy is user input, so every problem is reported with where it is: the file,
the line and the dotted path of the field (``classes[1].gamma.max``). All problems
found in one pass are collected into a single :class:`PolicyError`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy document."""

    file: str
    """Where the policy came from (a path, or ``<string>`` for inline text)."""
    line: int
    """1-based line of the offending field (the nearest existing parent if missing)."""
    path: str
    """Dotted path of the field, e.g. ``classes[0].gamma.initial`` (``<root>`` for the document)."""
    message: str
    """What is wrong, in words."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class PolicyError(ValueError):
    """A policy failed to parse or validate; ``errors`` lists every problem found."""

    def __init__(self, errors: list[PolicyIssue]):
        if not errors:
            raise ValueError("PolicyError needs at least one PolicyIssue")
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


class StateError(RuntimeError):
    """The requested state change is not possible (e.g. promote with no rollout)."""


class StaleEpochError(StateError):
    """A write carried a fencing epoch older than the current leader lease's epoch.

    Raised by the store before anything is changed: the writer lost leadership and
    must stop acting.
    """

    def __init__(self, epoch: int, current: int):
        self.epoch = epoch
        self.current = current
        super().__init__(f"stale fencing epoch {epoch} (current leader epoch is {current}); nothing was written")


class LeaseLostError(StaleEpochError):
    """A fenced write carried the current epoch but not the lease holder's token.

    After Redis lost its data (restart without persistence, failover to a lagging
    replica) a new leader can be handed an epoch an old, paused leader still holds;
    the token check rejects the old leader's writes all the same.
    """

    def __init__(self, epoch: int, current: int):
        super().__init__(epoch, current)
        self.args = (f"the leader lease is no longer held by this writer (epoch {epoch}, current {current}); "
                     "nothing was written",)


class ConflictError(StateError):
    """Optimistic concurrency failure: the rollout state changed since it was read."""


class CurrentChangedError(ConflictError):
    """A write conditional on the current revision found another one current (e.g. already rolled back)."""

    def __init__(self, expected: int, current: int | None):
        self.expected = expected
        self.current = current
        super().__init__(f"the current revision is {current}, not {expected} as this change expected; "
                         "nothing was written")


class StoreUnavailableError(RuntimeError):
    """Redis could not be reached; a temporary failure, retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)
