"""Fuzzed policies (hypothesis): the default policy with values, keys and whole sections mutated.

Each case is written to a file and parsed with the validator the CLI uses. Figures:
crashes (anything but a `PolicyError` or a policy), validator errors with an issue
that does not name the file and a line (``FILE:LINE:``), and partial applies: every case is also
offered to a real Redis store (``put_revision``; the store validates again), and
the store must then hold exactly the revisions of the valid cases, each parsing.
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path
from typing import Any

from specops.chaos.result import ScenarioResult
from specops.chaos.rig import POLICY, Rig

NAME = "fuzzed policies"
NAMESPACE = "chaos-policies"


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``doc`` (dict keys and list indexes)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _strategy(base: dict):
    from hypothesis import strategies as st

    paths = _paths(base)
    values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                       st.text(max_size=12), st.lists(st.integers(-5, 20), max_size=3),
                       st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
                       st.sampled_from(["draft", "medusa", "ngram", "off", "goodput", "bandit", "fixed", "<", ">=",
                                        "acceptance", "speedup", "fallback", "rollback", "(", "[a-", "ßß"]))
    mutation = st.tuples(st.sampled_from(paths), values, st.booleans())
    return st.lists(mutation, min_size=1, max_size=4)


def run(rig: Rig, *, cases: int) -> ScenarioResult:
    import redis
    import yaml
    from hypothesis import HealthCheck, given, settings

    from specops.policies import PolicyError, load_policy
    from specops.policies.store import PolicyStore

    base_text = POLICY.read_text()
    base = yaml.safe_load(base_text)
    default_policy = load_policy(str(POLICY))
    rig.ensure_redis()
    client = redis.Redis(host="127.0.0.1", port=rig.redis_port, socket_timeout=10)
    store = PolicyStore(client, namespace=NAMESPACE)
    client.delete(store.names.revisions, store.names.seq)
    tally = {"cases": 0, "valid": 0, "rejected": 0, "crashes": 0, "errors_without_file_line": 0,
             "stored": 0, "store_refused_valid": 0, "store_accepted_invalid": 0}
    notes: list[str] = []
    tmp = tempfile.TemporaryDirectory(prefix="specops-policy-fuzz-")
    path = Path(tmp.name) / "policy.yaml"
    where = re.compile(re.escape(str(path)) + r":\d+: ")

    @settings(max_examples=cases, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(_strategy(base))
    def one(mutations) -> None:
        doc = copy.deepcopy(base)
        for p, value, delete in mutations:
            try:
                doc = _set(doc, p, value, delete and bool(p))
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed or replaced this path
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
        path.write_text(text)
        tally["cases"] += 1
        policy = None
        try:
            policy = load_policy(str(path))
            tally["valid"] += 1
        except PolicyError as exc:
            tally["rejected"] += 1
            if not all(issue.file == str(path) and issue.line >= 1 and where.match(str(issue))
                       for issue in exc.errors):
                tally["errors_without_file_line"] += 1
                notes.append(str(exc)[:200])
        except Exception as exc:  # a crash of the validator
            tally["crashes"] += 1
            notes.append(f"{type(exc).__name__}: {exc}"[:200])
        # the store validates on its own: offer it every case (an invalid one with the default object)
        try:
            store.put_revision(policy or default_policy, text, actor="chaos-fuzz")
            tally["stored"] += 1
            if policy is None:
                tally["store_accepted_invalid"] += 1
        except (PolicyError, ValueError):
            if policy is not None:
                tally["store_refused_valid"] += 1

    try:
        one()
        stored = client.hlen(store.names.revisions)
        unparsable = 0
        for n in range(1, int(client.get(store.names.seq) or 0) + 1):
            try:
                store.get_revision(n)
            except Exception:
                unparsable += 1
    finally:
        client.close()
        tmp.cleanup()
    partial = abs(stored - tally["valid"]) + unparsable + tally["store_accepted_invalid"] + tally["store_refused_valid"]
    figures = {**tally, "partial_applies": partial}
    met = (tally["crashes"] == 0 and tally["errors_without_file_line"] == 0 and partial == 0
           and tally["valid"] > 0 and tally["rejected"] > 0)
    return ScenarioResult(NAME, figures, "0 crashes, 0 partial applies, 0 errors without FILE:LINE", met,
                          notes=notes[:5])
