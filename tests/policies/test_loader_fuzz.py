"""Fuzz the policy loader: any input gives a Policy or a PolicyError, and nothing invalid is stored."""

from __future__ import annotations

import copy
import re

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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(ALL_PATHS), values)
def test_nothing_is_stored_from_an_invalid_policy(redis_client, path, value):
    data = copy.deepcopy(VALID)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    text = yaml.safe_dump(data, sort_keys=False)
    store = PolicyStore(redis_client)
    keys_before = sorted(redis_client.keys("*"))
    audit_before = redis_client.xlen("{specops}:audit") if b"{specops}:audit" in keys_before else 0
    try:
        policy = load_policy(text)
    except PolicyError:
        assert sorted(redis_client.keys("*")) == keys_before
        return
    state = store.rollout_state()
    if state is not None and state.active:
        return
    start_rollout(store, policy, text)
    assert store.get_revision(store.history()[-1].revision).policy == policy
    assert redis_client.xlen("{specops}:audit") > audit_before
