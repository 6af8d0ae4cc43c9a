"""Tree topologies and buffers, checked against brute-force constructions."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specops.spec.tree import (
    PRESETS,
    TreeError,
    build_buffers,
    expected_accept_length,
    make_spec,
    preset,
    ranked_nodes,
    resolve_tree,
    sparse_tree,
)
from specops.spec.tree_size import VerifyCostCurve, choose_tree, measure_verify_cost
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)


def random_tree(rng: random.Random, max_nodes: int, max_depth: int, max_rank: int) -> list[tuple[int, ...]]:
    """A random prefix-closed set of paths, in random order."""
    nodes: set[tuple[int, ...]] = set()
    frontier = [()]
    for _ in range(rng.randint(0, max_nodes)):
        parent = rng.choice(frontier)
        if len(parent) >= max_depth:
            continue
        child = parent + (rng.randrange(max_rank),)
        if child not in nodes:
            nodes.add(child)
            frontier.append(child)
    paths = list(nodes)
    rng.shuffle(paths)
    return paths


def brute_force(paths: list[tuple[int, ...]]):
    """Buffers straight from the definitions, node order = (depth, path)."""
    order = [()] + sorted(paths, key=lambda p: (len(p), p))
    n = len(order)
    index = {p: i for i, p in enumerate(order)}
    mask = torch.tensor([[order[i][: len(order[j])] == order[j] for j in range(n)] for i in range(n)])
    depth = torch.tensor([len(p) for p in order])
    parent = torch.tensor([-1] + [index[p[:-1]] for p in order[1:]])
    leaves = [p for p in order if not any(len(q) == len(p) + 1 and q[: len(p)] == p for q in order)]
    rows = {tuple(index[leaf[:d]] for d in range(len(leaf) + 1)) for leaf in leaves}
    top_k = 1 + max((r for p in paths for r in p), default=0)
    cand = torch.tensor([(len(p) - 1) * top_k + p[-1] for p in order[1:]], dtype=torch.long)
    return mask, depth, parent, rows, cand


@pytest.mark.parametrize("seed", range(200))
def test_buffers_match_brute_force(seed):
    rng = random.Random(seed)
    paths = random_tree(rng, max_nodes=rng.choice([0, 3, 10, 40]), max_depth=rng.randint(1, 5),
                        max_rank=rng.randint(1, 4))
    buffers = build_buffers(make_spec(paths))
    mask, depth, parent, rows, cand = brute_force(paths)
    assert torch.equal(buffers.attn_mask, mask)
    assert torch.equal(buffers.depth, depth)
    assert torch.equal(buffers.parent, parent)
    assert torch.equal(buffers.candidate_index, cand)
    got_rows = {tuple(x for x in row if x >= 0) for row in buffers.retrieve.tolist()}
    assert got_rows == rows
    assert len(got_rows) == buffers.retrieve.shape[0]
    for i, kids in enumerate(buffers.children):
        assert sorted(kids) == [j for j in range(buffers.num_nodes) if int(parent[j]) == i]


def test_node_order_prefixes_are_trees():
    spec = preset("large", 5)
    for n in range(1, spec.num_nodes + 1):
        make_spec(spec.limit(max_nodes=n).paths)  # raises if a prefix is not prefix-closed
    assert spec.limit(max_depth=2).depth == 2


@pytest.mark.parametrize("bad, message", [
    ([(0, 1)], "no parent"),
    ([(0,), (0,)], "duplicate"),
    ([()], "root is implicit"),
    ([(0,), (0, -1)], "non-negative"),
    (["01"], "sequence of top-k ranks"),
])
def test_invalid_trees_raise(bad, message):
    with pytest.raises(TreeError, match=message):
        make_spec(bad)


def test_presets_respect_head_count():
    for name in PRESETS:
        for heads in range(1, 6):
            spec = preset(name, heads)
            assert spec.depth <= heads
            assert spec.num_nodes >= 2
    with pytest.raises(TreeError, match="unknown tree preset"):
        preset("nope", 3)
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        resolve_tree([(0,), (0, 0), (0, 0, 0)], 2)


def brute_force_best(accuracy, n):
    """Best expected accept length over every prefix-closed tree of n nodes."""
    universe = [p for d in range(1, len(accuracy) + 1) for p in itertools.product(range(len(accuracy[0])), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(universe, n - 1):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            best = max(best, expected_accept_length(make_spec(list(chosen)), accuracy))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_sparse_tree_is_optimal(seed):
    rng = random.Random(seed)
    accuracy = []
    for _ in range(2):
        raw = [rng.random() for _ in range(3)]
        scale = rng.uniform(0.3, 1.0) / sum(raw)
        accuracy.append(sorted((a * scale for a in raw), reverse=True))
    for n in range(1, 8):
        spec = sparse_tree(accuracy, n)
        assert spec.num_nodes == n
        assert expected_accept_length(spec, accuracy) == pytest.approx(brute_force_best(accuracy, n))


def test_ranked_nodes_values_are_path_products():
    accuracy = [[0.6, 0.2], [0.5, 0.1], [0.4]]
    for path, value in ranked_nodes(accuracy, 20):
        expected = 1.0
        for depth, rank in enumerate(path):
            expected *= accuracy[depth][rank]
        assert value == pytest.approx(expected)


def test_cost_curve_interpolates():
    curve = VerifyCostCurve(sizes=(1, 2, 4, 8), seconds=(1.0, 1.2, 1.4, 2.0))
    assert curve.at(1) == 1.0
    assert curve.at(3) == pytest.approx(1.3)
    assert curve.at(16) == pytest.approx(3.2)  # extrapolates the last segment
    assert curve.relative(8) == 2.0
    with pytest.raises(ValueError):
        VerifyCostCurve(sizes=(2, 4), seconds=(1.0, 2.0))


@pytest.mark.parametrize("slope", [0.0, 0.05, 0.3, 2.0])
def test_choose_tree_maximises_rate(slope):
    accuracy = [[0.7, 0.15, 0.05], [0.5, 0.15, 0.05], [0.4, 0.1]]
    curve = VerifyCostCurve(sizes=(1, 32), seconds=(1.0, 1.0 + 31 * slope))
    choice = choose_tree(accuracy, curve, overhead_s=0.1)
    rates = [expected_accept_length(sparse_tree(accuracy, n), accuracy) / (curve.at(n) + 0.1) for n in range(1, 33)]
    assert choice.tokens_per_s == pytest.approx(max(rates))
    assert choice.spec.num_nodes == 1 + max(range(32), key=lambda i: (rates[i], -i))
    if slope >= 2.0:
        assert choice.spec.num_nodes == 1  # speculation cannot pay: plain decoding


def test_measure_verify_cost_on_a_runner(tiny_llama_runner):
    runner = tiny_llama_runner
    curve = measure_verify_cost(runner, sizes=(1, 2, 4), prefix_len=8, repeats=1)
    assert curve.sizes == (1, 2, 4)
    assert all(s > 0 for s in curve.seconds)
    assert runner.cache_len == 0


@pytest.fixture
def tiny_llama_runner(one_thread):
    from specops.models.hf_runner import HFRunner

    return HFRunner(tiny_model("llama"))


ACCURACY = [[0.8, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1]]


def test_the_live_planner_starts_from_the_curve_and_follows_measured_step_times():
    """`TreePlanner` begins at the size the startup curve favours; when whole steps at that size
    measure slow it moves to the size with the best measured tokens per second; one step in
    EXPLORE_EVERY tries a neighbouring size, so a size that got cheaper is seen again."""
    from specops.spec import tree_size
    from specops.spec.tree_size import EXPLORE_EVERY, TreePlanner

    flat = VerifyCostCurve(sizes=(1, 32), seconds=(1.0, 1.0))  # at startup, every size costs one forward
    planner = TreePlanner(ACCURACY, flat, overhead_s=0.1)
    assert planner.sizes == tree_size.PLANNER_SIZES and planner.best_size() == 16  # free nodes: the biggest
    assert planner.best().num_nodes == 16
    for n in planner.sizes:  # the host changed: a step costs 1 + 0.3 per node beyond the root
        planner.observe(n, 1.0 + 0.3 * (n - 1))
    rates = {n: planner.expected[n] / (1.0 + 0.3 * (n - 1)) for n in planner.sizes}
    assert planner.best_size() == max(rates, key=rates.get) < 16
    best = planner.best_size()
    picked = [planner.next_spec().num_nodes for _ in range(4 * EXPLORE_EVERY)]
    explored = [n for n in picked if n != best]
    assert len(explored) == 4 and set(explored) <= set(planner.sizes) - {best}
    assert {abs(planner.sizes.index(n) - planner.sizes.index(best)) for n in explored} == {1}  # neighbours
    planner.observe(best, 100.0)  # one slow step moves the estimate by COST_EMA of the way, not all of it
    assert planner.cost[best] == pytest.approx(1.0 + 0.3 * (best - 1) + tree_size.COST_EMA * (100.0 - 1.0 - 0.3 * (best - 1)))
    other = next(n for n in planner.sizes if n != planner.best_size())
    was = planner.cost[other]
    planner.observe(other, was + 1.0)  # an explored size's new timing counts for more
    assert planner.cost[other] == pytest.approx(was + tree_size.EXPLORED_WEIGHT)
    before = dict(planner.cost)
    planner.observe(5, 1.0)  # not a planner size
    planner.observe(best, 0.0)  # not a timing
    assert planner.cost == before


def test_the_live_planner_keeps_a_bound_and_plain_decoding_when_nothing_pays():
    from specops.spec.tree_size import TreePlanner

    steep = VerifyCostCurve(sizes=(1, 32), seconds=(1.0, 63.0))  # every node doubles the step
    planner = TreePlanner(ACCURACY, steep, overhead_s=0.0, max_nodes=5)
    assert max(planner.sizes) <= 5
    assert planner.best_size() == 1  # speculation cannot pay: the root alone, a plain step
    with pytest.raises(TreeError):
        TreePlanner(ACCURACY, steep, overhead_s=0.0, max_nodes=0)


def test_measure_verify_cost_times_the_one_call_verification_where_decoding_uses_it(one_thread, monkeypatch):
    """``one_call=True`` on the fast runner times `BlockVerifier.verify` (what greedy decoding
    runs) for every size; elsewhere, or by default, it times `forward`."""
    from specops.models.fast_llama import BlockVerifier, FastLlamaRunner
    from specops.models.hf_runner import HFRunner
    from specops.kernels import cpu_linear

    assert cpu_linear.available(), cpu_linear.unavailable_reason()  # CI builds the kernels: never a skip
    fast = FastLlamaRunner(tiny_model("llama"))
    calls = []
    verify = BlockVerifier.verify
    monkeypatch.setattr(BlockVerifier, "verify", lambda self, tokens: calls.append(len(tokens)) or verify(self, tokens))
    curve = measure_verify_cost(fast, sizes=(1, 2, 4), prefix_len=8, repeats=2, one_call=True)
    assert curve.how == "one C call" and sorted(set(calls)) == [1, 2, 4] and len(calls) == 3 * 3
    assert fast.cache_len == 0 and all(s > 0 for s in curve.seconds)
    calls.clear()
    assert measure_verify_cost(fast, sizes=(1, 2), prefix_len=8, repeats=1).how == "forward" and not calls
    assert measure_verify_cost(HFRunner(tiny_model("llama")), sizes=(1, 2), prefix_len=8, repeats=1,
                               one_call=True).how == "forward"
