"""The canary rollout state machine for policy revisions (Argo Rollouts' verbs).

::

    start ──► progressing(step 0) ──promote / pause elapsed──► step 1 … ──► healthy (canary is current)
                 │   ▲                                                     ▲
                 │   └── promote (resume) ── paused ◄── pause (inconclusive)│
                 ├── abort ─────► aborted   (traffic back on stable)        │
                 └── fail ──────► degraded  (analysis failed: automatic     │
                                             rollback to stable)            │
    promote --full ─────────────────────────────────────────────────────────┘
    rollback [--to-revision N]: make an earlier revision current (aborts any canary)

``weight`` is the percent of traffic the runtimes send to the canary revision; the
rest uses the stable (current) revision. The controller runs the analysis (see
``specops.controller.analysis``) and calls :func:`record_analysis`, :func:`fail`,
:func:`pause` and :func:`advance_if_due`; the CLI calls :func:`start_rollout`,
:func:`promote`, :func:`abort` and :func:`rollback`. Every transition is one
atomic, fenced store write that compares-and-sets the state's generation, so two
writers never interleave (the loser gets :class:`ConflictError` and re-reads).

The very first rollout into an empty store has nothing to compare against and
becomes current at once (as Argo Rollouts does for the first revision).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from collections.abc import Callable

from specops.policies.errors import ConflictError, CurrentChangedError, StateError
from specops.policies.schema import Policy
from specops.policies.state import EffectiveSettings, RolloutState
from specops.policies.store import Fence, PolicyStore

Epoch = int | Fence | None  # a leader's fence, a bare epoch, or None for operator actions


def effective_for(policy: Policy, revision: int, now: float,
                  previous: dict[str, EffectiveSettings] | None = None) -> dict[str, EffectiveSettings]:
    """Per-class settings when ``policy`` becomes current.

    A class that already existed with the same method keeps its adapted γ / heads /
    tree size, clamped into the new bounds; anything else starts at the policy's
    initial values. Fallbacks are cleared: the new policy is a fresh decision.
    """
    previous = previous or {}
    out: dict[str, EffectiveSettings] = {}
    for c in policy.classes:
        old = previous.get(c.name)
        keep = old is not None and old.method == c.method
        out[c.name] = EffectiveSettings(
            request_class=c.name,
            method=c.method,
            gamma=c.gamma.clamp(old.gamma) if keep else c.gamma.initial,
            medusa_heads=c.medusa_heads.clamp(old.medusa_heads) if keep else c.medusa_heads.initial,
            tree_size=c.tree_size.clamp(old.tree_size) if keep else c.tree_size.initial,
            fallback_active=False,
            probe_fraction=c.adaptation.probe_fraction,
            revision=revision,
            updated_at=now,
        )
    return out


def pick_revision(state: RolloutState | None, stable: int, routing_key: str) -> int:
    """Which revision serves a request: a stable hash of ``routing_key`` puts ``weight``% on the canary."""
    if state is None or not state.active or state.weight <= 0:
        return stable
    bucket = int.from_bytes(hashlib.sha256(routing_key.encode()).digest()[:4], "big") % 100
    return state.revision if bucket < state.weight else stable


def start_rollout(store: PolicyStore, policy: Policy, text: str, *, epoch: Epoch = None,
                  actor: str = "operator") -> RolloutState:
    """Store ``policy`` as a new revision and start rolling it out as the canary at step 0."""
    state = store.rollout_state()
    if state is not None and state.active:
        raise StateError(f"revision {state.revision} is being rolled out ({state.phase}); "
                         "promote --full or abort it first")
    stable = store.current_revision()
    revision = store.put_revision(policy, text, epoch=epoch, actor=actor)
    now = store.clock()
    expect = state.generation if state is not None else 0
    if stable is None:
        new = RolloutState(revision=revision, stable_revision=None, step_index=len(policy.rollout.steps),
                           phase="healthy", weight=100, message="first revision: current at once",
                           step_started_at=now, updated_at=now)
        store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=expect, current=revision,
                     clear_canary=True, effective=effective_for(policy, revision, now), effective_replace=True,
                     audit=("rollout.start", {"revision": revision, "stable_revision": None, "first": True}))
        return store.rollout_state() or new
    first = policy.rollout.steps[0]
    new = RolloutState(revision=revision, stable_revision=stable, step_index=0, phase="progressing",
                       weight=first.weight, message=f"step 0: {first.weight}% on revision {revision}",
                       step_started_at=now, updated_at=now)
    store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=expect, canary=revision,
                 audit=("rollout.start", {"revision": revision, "stable_revision": stable, "weight": first.weight}))
    return store.rollout_state() or new


def _active(store: PolicyStore) -> RolloutState:
    state = store.rollout_state()
    if state is None:
        raise StateError("no rollout: run `specops policy rollout FILE` first")
    if not state.active:
        raise StateError(f"no rollout in progress (revision {state.revision} is {state.phase})")
    return state


def promote(store: PolicyStore, *, full: bool = False, epoch: Epoch = None, actor: str = "operator",
            reason: str = "promoted") -> RolloutState:
    """Advance the canary one step (resuming it if paused); ``full`` skips to 100% and completes."""
    state = _active(store)
    policy = store.get_revision(state.revision).policy
    steps = policy.rollout.steps
    nxt = len(steps) if full else state.step_index + 1
    if state.phase == "paused" and not full:
        nxt = state.step_index  # promote on a paused rollout resumes the current step
    return _go_to_step(store, state, policy, nxt, epoch=epoch, actor=actor, reason=reason)


def _go_to_step(store: PolicyStore, state: RolloutState, policy: Policy, index: int, *, epoch: Epoch,
                actor: str, reason: str) -> RolloutState:
    now = store.clock()
    steps = policy.rollout.steps
    if index >= len(steps):
        new = replace(state, step_index=len(steps), phase="healthy", weight=100, step_started_at=now, updated_at=now,
                      attempt=state.attempt + 1, message=f"revision {state.revision} is current ({reason})")
        store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation,
                     current=state.revision, clear_canary=True,
                     effective=effective_for(policy, state.revision, now, store.effective()), effective_replace=True,
                     audit=("rollout.complete", {"revision": state.revision, "from_step": state.step_index,
                                                 "stable_revision": state.stable_revision, "reason": reason}))
    else:
        step = steps[index]
        new = replace(state, step_index=index, phase="progressing", weight=step.weight, step_started_at=now,
                      updated_at=now, attempt=state.attempt + 1,
                      message=f"step {index}: {step.weight}% on revision {state.revision} ({reason})")
        store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation,
                     audit=("rollout.step", {"revision": state.revision, "from_step": state.step_index,
                                             "to_step": index, "weight": step.weight, "reason": reason}))
    return store.rollout_state() or new


def abort(store: PolicyStore, *, reason: str = "aborted by operator", epoch: Epoch = None,
          actor: str = "operator") -> RolloutState:
    """Stop the canary: all traffic back on the stable revision; the rollout is marked aborted."""
    return _stop(store, "aborted", reason, epoch=epoch, actor=actor)


def fail(store: PolicyStore, *, reason: str, epoch: Epoch = None, actor: str = "controller",
         expect_generation: int | None = None) -> RolloutState:
    """Analysis failed: roll the canary back to the stable revision automatically (phase degraded).

    ``expect_generation``: only if the rollout state is still the one the decision was
    taken on (:class:`ConflictError` otherwise), so a repeated failure signal never
    acts on a later rollout.
    """
    return _stop(store, "degraded", reason, epoch=epoch, actor=actor, expect_generation=expect_generation)


def _stop(store: PolicyStore, phase: str, reason: str, *, epoch: Epoch, actor: str,
          expect_generation: int | None = None) -> RolloutState:
    state = _active(store)
    if expect_generation is not None and state.generation != expect_generation:
        raise ConflictError(f"rollout state changed since the decision (generation {state.generation}, "
                            f"expected {expect_generation})")
    now = store.clock()
    new = replace(state, phase=phase, weight=0, updated_at=now,
                  message=f"{reason}; traffic back on revision {state.stable_revision}")
    store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation, clear_canary=True,
                 audit=(f"rollout.{phase}", {"revision": state.revision, "stable_revision": state.stable_revision,
                                             "step_index": state.step_index, "reason": reason}))
    return store.rollout_state() or new


def pause(store: PolicyStore, *, reason: str, epoch: Epoch = None, actor: str = "controller") -> RolloutState:
    """Hold the canary at its current weight until an operator promotes (or aborts) it."""
    state = _active(store)
    now = store.clock()
    new = replace(state, phase="paused", updated_at=now, message=f"paused: {reason}")
    store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation,
                 audit=("rollout.pause", {"revision": state.revision, "step_index": state.step_index, "reason": reason}))
    return store.rollout_state() or new


def rollback(store: PolicyStore, *, to_revision: int | None = None, epoch: Epoch = None,
             actor: str = "operator", reason: str = "rollback", expect_current: int | None = None) -> RolloutState:
    """Make an earlier revision current (default: the one current before this one); aborts any canary.

    The default target passes over revisions that were themselves rolled back from,
    so rolling back twice never returns to the revision judged bad. With
    ``expect_current`` the rollback applies only while that revision is current
    (:class:`~specops.policies.errors.CurrentChangedError` otherwise): a rollback
    decided against revision N happens once, however often it is requested.
    """
    current = store.current_revision()
    if current is None:
        raise StateError("nothing to roll back: no revision is current")
    if expect_current is not None and current != expect_current:
        raise CurrentChangedError(expect_current, current)
    target = to_revision if to_revision is not None else store.previous_current(skip_rolled_back=True)
    if target is None:
        raise StateError(f"no earlier revision to roll back to (revision {current} is the only one made current "
                         "that was not rolled back from)")
    if target == current:
        raise StateError(f"revision {target} is already current")
    policy = store.get_revision(target).policy  # raises StateError for an unknown revision
    state = store.rollout_state()
    now = store.clock()
    new = RolloutState(revision=target, stable_revision=target, step_index=len(policy.rollout.steps),
                       phase="healthy", weight=100, message=f"rolled back from revision {current} to {target} ({reason})",
                       step_started_at=now, updated_at=now)
    store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation if state else 0,
                 current=target, clear_canary=True, rollback=True, expect_current=current,
                 effective=effective_for(policy, target, now, store.effective()), effective_replace=True,
                 audit=("rollout.rollback", {"from_revision": current, "to_revision": target, "reason": reason,
                                             "aborted_canary": state.revision if state and state.active else None}))
    return store.rollout_state() or new


def record_analysis(store: PolicyStore, run: dict[str, Any], *, epoch: Epoch = None,
                    actor: str = "controller", then: str = "continue", reason: str = "",
                    expect_generation: int | None = None) -> RolloutState:
    """Append one analysis run (``{"outcome": ..., "message": ..., ...}``) to the active rollout.

    ``then`` is the verdict on the runs including this one, applied in the SAME write:
    ``continue``, ``pause`` (phase paused) or ``rollback`` (phase degraded, traffic
    back on stable). A failed analysis therefore can never be recorded without its
    consequence. ``expect_generation``: the state the run was evaluated on.
    """
    if run.get("outcome") not in ("successful", "failed", "inconclusive"):
        raise ValueError(f"analysis run needs an outcome successful|failed|inconclusive, got {run.get('outcome')!r}")
    if then not in ("continue", "pause", "rollback"):
        raise ValueError(f"then must be continue, pause or rollback, got {then!r}")
    state = _active(store)
    if expect_generation is not None and state.generation != expect_generation:
        raise ConflictError(f"rollout state changed while analysing (generation {state.generation}, "
                            f"expected {expect_generation})")
    now = store.clock()
    entry = {"at": now, "step_index": state.step_index, "attempt": state.attempt, **run}
    new = replace(state, analysis_runs=[*state.analysis_runs, entry], updated_at=now)
    audit = [("rollout.analysis", {"revision": state.revision, **entry, "verdict": then, "verdict_reason": reason})]
    clear = False
    if then == "rollback":
        new = replace(new, phase="degraded", weight=0,
                      message=f"analysis: {reason}; traffic back on revision {state.stable_revision}")
        audit.append(("rollout.degraded", {"revision": state.revision, "stable_revision": state.stable_revision,
                                           "step_index": state.step_index, "reason": f"analysis: {reason}"}))
        clear = True
    elif then == "pause":
        new = replace(new, phase="paused", message=f"paused: analysis: {reason}")
        audit.append(("rollout.pause", {"revision": state.revision, "step_index": state.step_index,
                                        "reason": f"analysis: {reason}"}))
    store.commit(epoch=epoch, actor=actor, rollout=new, expect_generation=state.generation, clear_canary=clear,
                 audit=audit)
    return store.rollout_state() or new


def advance_if_due(store: PolicyStore, *, epoch: Epoch = None, actor: str = "controller",
                   gate: Callable[[RolloutState, Policy], str | None] | None = None) -> RolloutState | None:
    """Move a progressing canary to its next step once the step's pause is over.

    A step with ``pause_s: null`` waits for ``promote``. A step with ``analysis: true``
    also needs at least one successful analysis run during the step (this attempt).
    ``gate(state, canary_policy)`` may refuse with a reason: it sees exactly the state
    that is advanced (the write compares-and-sets its generation), so a verdict checked
    there cannot be overtaken by a run recorded meanwhile. Returns the new state, or
    None when nothing was due.
    """
    state = store.rollout_state()
    if state is None or state.phase != "progressing":
        return None
    policy = store.get_revision(state.revision).policy
    step = policy.rollout.steps[state.step_index]
    if step.pause_s is None or store.clock() - state.step_started_at < step.pause_s:
        return None
    if step.analysis and not any(r.get("outcome") == "successful" for r in state.current_runs()):
        return None
    if gate is not None:
        refused = gate(state, policy)
        if refused:
            return None
    return _go_to_step(store, state, policy, state.step_index + 1, epoch=epoch, actor=actor,
                       reason=f"step {state.step_index} pause of {step.pause_s:g}s elapsed")
