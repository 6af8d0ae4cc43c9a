"""Fuzz the policy loader: any input gives a Policy or a PolicyError, and nothing invalid is stored."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specops.policies import Policy, PolicyError, load_policy
from specops.policies.rollout import start_rollout
from specops.policies.store import PolicyStore

VALID = {
    "version": "f1",
    "default_class": "b",
    "classes": [
        {"name": "a", "match": [{"prefix": "x", "max_prompt_tokens": 9}], "method": "medusa",
         "medusa_heads": {"initial": 2, "min": 1, "max": 3}, "adaptation": {"mode": "bandit"}},
        {"name": "b", "gamma": {"initial": 2, "min": 1, "max": 4}, "temperature": {"min": 0, "max": 1}},
    ],
    "alerts": [{"name": "r", "metric": "speedup", "op": "<", "threshold": 1.0, "classes": ["a"]}],
    "rollout": {"steps": [{"weight": 20, "pause_s": 5}, {"weight": 100}], "analysis": {"rules": ["r"]}},
}

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["draft", "medusa", "<", "a", "b", "r", "fallback", "", "1e9", "~"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(VALID) if p]


def _check(text: str) -> Policy | None:
    try:
        return load_policy(text, filename="fuzz.yaml")
    except PolicyError as exc:
        # YAML breaks lines at \r, \r\n, \x85, \u2028 and \u2029 as well as \n (so do editors)
        n_lines = len(re.split("\r\n|[\r\n\x85\u2028\u2029]", text)) + 1
        for issue in exc.errors:
            assert issue.file == "fuzz.yaml" and issue.path and issue.message
            assert 0 <= issue.line <= n_lines, str(issue)
        return None


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_never_crashes(text):
    _check(text)


@FUZZ
@given(st.sampled_from(ALL_PATHS), values, st.sampled_from(["replace", "delete", "add"]))
def test_mutated_policy_is_valid_or_a_policy_error(path, value, how):
    data = copy.deepcopy(VALID)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if how == "replace":
        parent[last] = value
    elif how == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[f"extra_{last}"] = value
    else:
        parent.append(value)
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    policy = _check(text)
    if how == "add" and isinstance(parent, dict):
        assert policy is None, "an unknown field was accepted"
    if policy is not None:
        assert policy == load_policy(text)   # deterministic


@FUZZ
@given(st.dictionaries(st.sampled_from(list(VALID) + ["x"]), values, max_size=6))
def test_random_top_level_documents(doc):
    _check(yaml.safe_dump(doc))


# Mutations that keep the policy valid (so the storing branch runs often): (path, strategy)
VALID_MUTATIONS = [
    (("version",), st.text("abcxyz0123456789.-", min_size=1, max_size=8)),
    (("classes", 0, "medusa_heads", "initial"), st.integers(1, 3)),
    (("classes", 1, "gamma", "initial"), st.integers(1, 4)),
    (("classes", 0, "match", 0, "prefix"), st.text("abc def_(", min_size=1, max_size=6)),
    (("alerts", 0, "threshold"), st.floats(0.1, 5.0)),
    (("rollout", "steps", 0, "weight"), st.integers(1, 99)),
    (("rollout", "steps", 0, "pause_s"), st.integers(0, 600)),
]
mutations = st.one_of(
    st.sampled_from(VALID_MUTATIONS).flatmap(lambda pv: st.tuples(st.just(pv[0]), pv[1])),
    st.tuples(st.sampled_from(ALL_PATHS), values),
)


def _snapshot(redis_client) -> dict:
    """Every key with its serialised value: any write shows up as a difference."""
    return {key: redis_client.dump(key) for key in sorted(redis_client.keys("*"))}


def test_nothing_is_stored_from_an_invalid_policy(redis_client, redis_url, tmp_path):
    """Each mutated policy goes through the calls that store (``start_rollout``,
    ``PolicyStore.put_revision`` and ``specops policy rollout FILE``) on top of a stored
    baseline: an invalid one leaves every key and value in Redis unchanged, a valid one
    becomes a new revision and the canary. Both branches must run many times."""
    from click.testing import CliRunner

    from specops.cli import main
    from specops.policies.rollout import abort

    baseline_text = yaml.safe_dump(VALID, sort_keys=False)
    baseline = load_policy(baseline_text)
    runner = CliRunner()
    ran = {"valid": 0, "invalid": 0}

    # derandomized: the same 80 mutations every run, so the count of each branch below is fixed
    @settings(max_examples=80, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutations)
    def one(mutation):
        path, value = mutation
        data = copy.deepcopy(VALID)
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = value
        text = yaml.safe_dump(data, sort_keys=False)
        redis_client.flushall()
        store = PolicyStore(redis_client)
        start_rollout(store, baseline, baseline_text)  # revision 1, current
        before = _snapshot(redis_client)
        try:
            policy = load_policy(text)
        except PolicyError:
            policy = None
        if policy is None:
            ran["invalid"] += 1
            with pytest.raises((PolicyError, ValueError)):
                start_rollout(store, baseline, text)  # the object is valid, its text is not
            with pytest.raises((PolicyError, ValueError)):
                store.put_revision(baseline, text)
            file = tmp_path / "bad.yaml"
            file.write_text(text)
            result = runner.invoke(main, ["policy", "rollout", str(file)], env={"SPECOPS_REDIS": redis_url})
            assert result.exit_code != 0, result.output
            assert _snapshot(redis_client) == before
            return
        ran["valid"] += 1
        state = start_rollout(store, policy, text)
        assert state.active and store.canary_revision() == state.revision == 2
        assert store.get_revision(2).policy == policy and store.get_revision(2).text == text
        assert _snapshot(redis_client) != before
        abort(store)

    one()
    assert ran["valid"] >= 15 and ran["invalid"] >= 15, ran
