"""A policy retargeted to the speculative methods one server has.

A real model is often served alone: no draft model, no Medusa heads, perhaps an EAGLE
drafter. A policy written for the bundled models (`examples/policies/`) names methods such
a server lacks, and a class on a missing method would decode plainly. `retarget_policy`
keeps every class, match rule, alert and the rollout as written and moves only the classes
whose method needs a part the server lacks:

``eagle``  when the server has an EAGLE drafter and the class is sampled (every match rule asks
           for a temperature above greedy: a sampled token seldom continues a copied n-gram) or
           on Medusa heads (EAGLE drafts from the target's own features, as the heads do);
``ngram``  otherwise: prompt lookup needs no model part.

``off``, ``auto`` (the server's auto picks among the methods it loaded) and ``ngram`` are
always available. A class leaving ``medusa`` leaves its Medusa knobs behind. `specops demo
--model` and `specops bench serve --model` serve their model with the policy this returns.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

ALWAYS = ("off", "auto", "ngram")


def sampled(rc: Any) -> bool:
    """Whether every match rule of class ``rc`` asks for a temperature above greedy."""
    return bool(rc.match) and all(r.temperature is not None and r.temperature.min > 0 for r in rc.match)


def retarget_policy(text: str, available: Collection[str], *, source: str = "<policy>") -> tuple[str, dict[str, str]]:
    """Policy YAML ``text`` for a server whose speculative methods are ``available`` (see the
    module docstring): the new YAML (its version marked ``+METHODS`` where a class moved) and
    each class's method. Raises `PolicyError` for a policy that does not load."""
    import yaml

    from specops.policies.loader import parse_policy

    policy = parse_policy(text, source)
    has = set(available) | set(ALWAYS)
    data = yaml.safe_load(text)
    methods: dict[str, str] = {}
    moved = False
    for raw, rc in zip(data["classes"], policy.classes):
        method = rc.method
        if method not in has:
            method = "eagle" if "eagle" in has and (method == "medusa" or sampled(rc)) else "ngram"
            raw["method"] = method
            if rc.method == "medusa":
                for knob in ("medusa_heads", "tree_size", "lookup_branch", "typical"):
                    raw.pop(knob, None)
            moved = True
        methods[rc.name] = method
    if not moved:
        return text, methods
    used = "-".join(m for m in ("ngram", "eagle", "auto") if m in methods.values()) or "off"
    data["version"] = f"{policy.version}+{used}"[-200:]
    out = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    parse_policy(out, source)  # what the server will load must load
    return out, methods
