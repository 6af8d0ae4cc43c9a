"""The tree-size bound of a Medusa class and of an eagle class drafting EAGLE-2 trees is adapted,
and bandit statistics survive a failover."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from specops.controller.adapt import BanditState, tree_size_arms
from specops.controller.controller import Controller
from tests.controller.test_controller import Rig

MEDUSA = """
version: m1
default_class: code
classes:
  - name: code
    method: medusa
    medusa_heads: {initial: 2, min: 1, max: 4}
    tree_size: {initial: 16, min: 4, max: 64}
    adaptation: {mode: bandit, dead_band: 0.03, cooldown_s: 10, max_step: 1}
"""


def test_tree_size_arms_are_a_doubling_grid_within_bounds():
    assert tree_size_arms(4, 64) == [4, 8, 16, 32, 64]
    assert tree_size_arms(5, 30) == [5, 10, 20, 30]
    assert tree_size_arms(7, 7) == [7]


def test_tree_size_is_adapted_within_its_range_one_grid_step_at_a_time(redis_client):
    rig = Rig(redis_client, MEDUSA)
    sizes, heads = [], []
    for _ in range(40):
        rig.step({"code": (0.8, 1.0)})
        rig.clock.advance(10)
        eff = rig.store.effective()["code"]
        sizes.append(eff.tree_size)
        heads.append(eff.medusa_heads)
    grid = tree_size_arms(4, 64)
    assert len(set(sizes)) > 1 and set(sizes) <= set(grid)
    moves = [(a, b) for a, b in zip([16, *sizes], sizes) if a != b]
    assert all(abs(grid.index(a) - grid.index(b)) == 1 for a, b in moves)
    # one knob per window: never heads and tree size in the same tick
    both = [i for i in range(1, 40) if sizes[i] != sizes[i - 1] and heads[i] != heads[i - 1]]
    assert both == []
    events = [e for e in rig.store.read_audit(500) if e["kind"] == "effective.set" and "tree size" in
              e["inputs"].get("code", {}).get("reason", "")]
    assert events and "tree_estimates" in events[-1]["inputs"]["code"]


def test_bandit_statistics_are_kept_in_redis_and_restored_on_failover(redis_client):
    rig = Rig(redis_client, MEDUSA)
    for _ in range(12):
        rig.step({"code": (0.8, 1.0)})
        rig.clock.advance(10)
    stored = rig.store.bandit_stats()["code"]
    arms = {knob: BanditState.from_dict(data) for knob, data in stored.items()}
    assert set(arms) == {"medusa_heads", "tree_size"} and sum(arms["tree_size"].weight.values()) > 1
    # a new leader (empty memory) continues from those statistics instead of exploring from scratch
    successor = Controller(rig.store, rig.ctl.source, clock=rig.clock, registry=CollectorRegistry(), window_s=10)
    rig.ctl = successor
    rig.clock.advance(30)
    rig.step({"code": (0.8, 1.0)})
    after = BanditState.from_dict(rig.store.bandit_stats()["code"]["medusa_heads"])
    before = arms["medusa_heads"]
    total_before = sum(before.weight.values())
    assert abs(sum(after.weight.values()) - (total_before * before.discount + 1.0)) < 1e-9


EAGLE = """
version: e1
default_class: code
classes:
  - name: code
    method: eagle
    eagle_topk: 3
    gamma: {initial: 4, min: 1, max: 6}
    tree_size: {initial: 16, min: 4, max: 64}
    adaptation: {mode: bandit, dead_band: 0.03, cooldown_s: 10, max_step: 1}
  - name: chat
    method: eagle
    match: [{prefix: "hi"}]
    gamma: {initial: 4, min: 1, max: 6}
    tree_size: {initial: 16, min: 4, max: 64}
    adaptation: {mode: bandit, dead_band: 0.03, cooldown_s: 10, max_step: 1}
"""


def test_an_eagle_class_drafting_trees_has_its_tree_size_adapted_and_a_chain_class_not(redis_client):
    """The tree size bounds an eagle class's EAGLE-2 trees (``eagle_topk``): the controller moves it
    as a Medusa class's, on ticks where γ holds; a chain class's tree size is no knob of it."""
    rig = Rig(redis_client, EAGLE, method="eagle")
    sizes, gammas, chat = [], [], []
    for _ in range(40):
        rig.step({"code": (0.8, 1.0), "chat": (0.8, 1.0)})
        rig.clock.advance(10)
        eff = rig.store.effective()
        sizes.append(eff["code"].tree_size)
        gammas.append(eff["code"].gamma)
        chat.append(eff["chat"].tree_size)
    grid = tree_size_arms(4, 64)
    assert len(set(sizes)) > 1 and set(sizes) <= set(grid)
    assert [i for i in range(1, 40) if sizes[i] != sizes[i - 1] and gammas[i] != gammas[i - 1]] == []
    assert set(chat) == {16}
    assert set(rig.store.bandit_stats()["code"]) == {"gamma", "tree_size"}
