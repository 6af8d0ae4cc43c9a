"""Every field's bad value yields one error line naming the file, the line and the field."""

from __future__ import annotations

import pytest

from specops.policies import PolicyError, load_policy
from specops.policies.loader import format_path
from specops.policies.schema import LOOKUP_BRANCH

# A valid policy with every field on its own line, so each can be broken alone.
TEMPLATE = """\
version: "v1"
description: test policy
default_class: chat
classes:
  - name: code
    match:
      - prefix: "def "
        regex: "import"
        label:
          task: code
        min_prompt_tokens: 1
        max_prompt_tokens: 100
    method: draft
    gamma:
      initial: 4
      min: 1
      max: 8
    medusa_heads:
      initial: 2
      min: 1
      max: 4
    tree_size:
      initial: 8
      min: 2
      max: 16
    temperature:
      min: 0.0
      max: 1.0
    deadline_s: 10
    lookup_branch: 6
    typical: false
    adaptation:
      mode: goodput
      dead_band: 0.05
      cooldown_s: 30
      max_step: 2
      probe_fraction: 0.05
  - name: chat
alerts:
  - name: low
    metric: acceptance_rate
    op: "<"
    threshold: 0.5
    for_s: 60
    min_samples: 10
    action: fallback
    severity: warning
    classes:
      - code
rollout:
  steps:
    - weight: 10
      pause_s: 60
      analysis: true
    - weight: 100
  analysis:
    interval_s: 30
    window_s: 120
    failure_limit: 0
    inconclusive_limit: 1
    consecutive_error_limit: 4
    rules:
      - low
"""


def test_template_is_valid():
    policy = load_policy(TEMPLATE)
    assert policy.get_class("code").gamma.max == 8
    assert policy.alerts[0].classes == ["code"]


def _replace(line_text: str, new_text: str) -> tuple[str, int]:
    """TEMPLATE with the unique line ``line_text`` replaced; returns (text, 1-based line)."""
    lines = TEMPLATE.splitlines()
    hits = [i for i, ln in enumerate(lines) if ln == line_text]
    assert len(hits) == 1, f"template line not unique: {line_text!r}"
    lines[hits[0]] = new_text
    return "\n".join(lines) + "\n", hits[0] + 1


# (template line, replacement, expected path, fragment of the message)
CASES = [
    ('version: "v1"', "version: [1]", "version", "valid string"),
    ('version: "v1"', 'version: ""', "version", "at least 1 character"),
    ("description: test policy", "description: {a: 1}", "description", "valid string"),
    ("default_class: chat", "default_class: nope", "default_class", "unknown class 'nope'"),
    ("default_class: chat", "default_class: 5", "default_class", "valid string"),
    ("  - name: code", "  - name: Code!", "classes[0].name", "pattern"),
    ("  - name: chat", "  - name: code", "classes[1].name", "duplicate class name"),
    ('      - prefix: "def "', '      - prefix: ""', "classes[0].match[0].prefix", "at least 1 character"),
    ('        regex: "import"', '        regex: "(unclosed"', "classes[0].match[0].regex", "invalid regular expression"),
    ("          task: code", "          task: 3", "classes[0].match[0].label.task", "valid string"),
    ("        min_prompt_tokens: 1", "        min_prompt_tokens: -1", "classes[0].match[0].min_prompt_tokens", "greater than or equal to 0"),
    ("        max_prompt_tokens: 100", "        max_prompt_tokens: x", "classes[0].match[0].max_prompt_tokens", "valid integer"),
    ("        max_prompt_tokens: 100", "        max_prompt_tokens: 0", "classes[0].match[0]", "min_prompt_tokens (1) must be <= max_prompt_tokens (0)"),
    ("    method: draft", "    method: drafty", "classes[0].method", "'draft', 'medusa', 'ngram', 'eagle', 'auto' or 'off'"),
    ("      initial: 4", "      initial: 9", "classes[0].gamma", "initial (9) must lie within min..max (1..8)"),
    ("      initial: 4", "      initial: 4.5", "classes[0].gamma.initial", "valid integer"),
    ("      max: 8", "      max: 0", "classes[0].gamma", "min (1) must be <= max (0)"),
    ("      max: 4", "      max: 2000", "classes[0].medusa_heads.max", "less than or equal to 1024"),
    ("      initial: 2", "      initial: 0", "classes[0].medusa_heads", "initial (0) must lie within"),
    ("      min: 2", "      min: 0", "classes[0].tree_size", "min must be at least 1 for tree_size"),
    ("      max: 16", "      max: true", "classes[0].tree_size.max", "valid integer"),
    ("      min: 0.0", "      min: -0.5", "classes[0].temperature.min", "greater than or equal to 0"),
    ("      max: 1.0", "      max: .nan", "classes[0].temperature.max", "finite number"),
    ("    deadline_s: 10", "    deadline_s: 0", "classes[0].deadline_s", "greater than 0"),
    ("    lookup_branch: 6", "    lookup_branch: -1", "classes[0].lookup_branch", "greater than or equal to 0"),
    ("    lookup_branch: 6", "    lookup_branch: 65", "classes[0].lookup_branch", "less than or equal to 64"),
    ("    lookup_branch: 6", "    lookup_branch: four", "classes[0].lookup_branch", "valid integer"),
    ("    lookup_branch: 6", "    lookup_branch: true", "classes[0].lookup_branch", "valid integer"),
    ("    typical: false", "    typical: sometimes", "classes[0].typical", "valid boolean"),
    ("    typical: false", "    typical: 1", "classes[0].typical", "valid boolean"),
    ("    typical: false", "    typical: true", "classes[0].typical",
     "typical acceptance is lossy and applies to the medusa method only; this class's method is 'draft'"),
    ("      mode: goodput", "      mode: greedy", "classes[0].adaptation.mode", "'fixed', 'goodput' or 'bandit'"),
    ("      dead_band: 0.05", "      dead_band: 2", "classes[0].adaptation.dead_band", "less than or equal to 1"),
    ("      cooldown_s: 30", "      cooldown_s: -1", "classes[0].adaptation.cooldown_s", "greater than or equal to 0"),
    ("      max_step: 2", "      max_step: 0", "classes[0].adaptation.max_step", "greater than or equal to 1"),
    ("      probe_fraction: 0.05", "      probe_fraction: 1.5", "classes[0].adaptation.probe_fraction", "less than or equal to 1"),
    ("  - name: low", "  - name: ''", "alerts[0].name", "pattern"),
    ("    metric: acceptance_rate", "    metric: accuracy", "alerts[0].metric", "'acceptance_rate', 'speedup'"),
    ('    op: "<"', '    op: "=="', "alerts[0].op", "'<', '<=', '>' or '>='"),
    ("    threshold: 0.5", "    threshold: 1.5", "alerts[0].threshold", "ratio: threshold must lie in [0, 1]"),
    ("    for_s: 60", "    for_s: -5", "alerts[0].for_s", "greater than or equal to 0"),
    ("    min_samples: 10", "    min_samples: many", "alerts[0].min_samples", "valid integer"),
    ("    action: fallback", "    action: panic", "alerts[0].action", "'fallback', 'rollback' or 'notify'"),
    ("    severity: warning", "    severity: high", "alerts[0].severity", "'critical', 'warning' or 'info'"),
    ("      - code", "      - nosuch", "alerts[0].classes[0]", "unknown class 'nosuch'"),
    ("    - weight: 10", "    - weight: 101", "rollout.steps[0].weight", "less than or equal to 100"),
    ("    - weight: 100", "    - weight: 5", "rollout.steps", "weights must increase"),
    ("      pause_s: 60", "      pause_s: -1", "rollout.steps[0].pause_s", "greater than or equal to 0"),
    ("      analysis: true", "      analysis: maybe", "rollout.steps[0].analysis", "valid boolean"),
    ("    interval_s: 30", "    interval_s: 0", "rollout.analysis.interval_s", "greater than 0"),
    ("    window_s: 120", "    window_s: -3", "rollout.analysis.window_s", "greater than 0"),
    ("    failure_limit: 0", "    failure_limit: -1", "rollout.analysis.failure_limit", "greater than or equal to 0"),
    ("    inconclusive_limit: 1", "    inconclusive_limit: 1.5", "rollout.analysis.inconclusive_limit", "valid integer"),
    ("    consecutive_error_limit: 4", "    consecutive_error_limit: -2", "rollout.analysis.consecutive_error_limit", "greater than or equal to 0"),
    ("      - low", "      - nosuch", "rollout.analysis.rules[0]", "unknown alert rule 'nosuch'"),
    ("description: test policy", "descripton: test policy", "descripton", "unknown field"),
    ("    method: draft", "    methd: draft", "classes[0].methd", "unknown field (did you mean 'method'?"),
    ("      mode: goodput", "      mood: goodput", "classes[0].adaptation.mood", "unknown field"),
]


@pytest.mark.parametrize("old,new,path,fragment", CASES, ids=[f"{c[2]}:{c[1].strip()}" for c in CASES])
def test_bad_field_reports_its_line(old, new, path, fragment):
    text, line = _replace(old, new)
    with pytest.raises(PolicyError) as info:
        load_policy(text, filename="p.yaml")
    rendered = [str(e) for e in info.value.errors]
    wanted = [e for e in info.value.errors if e.path == path]
    assert wanted, f"no error for {path}; got {rendered}"
    issue = wanted[0]
    assert fragment in issue.message, rendered
    # Errors on a whole sub-object (cross-field checks) point at its key; others at the field itself.
    key_line = _line_of_key(text, path, line)
    assert issue.line == key_line, rendered
    assert str(issue).startswith(f"p.yaml:{key_line}: {path}: ")


def _line_of_key(text: str, path: str, changed_line: int) -> int:
    """The changed line, or for an error on a parent object the line that opens it."""
    parents = {
        "classes[0].gamma": "    gamma:", "classes[0].medusa_heads": "    medusa_heads:",
        "classes[0].tree_size": "    tree_size:", "classes[0].match[0]": '      - prefix: "def "',
        "rollout.steps": "  steps:",
    }
    if path in parents:
        return text.splitlines().index(parents[path]) + 1
    return changed_line


def test_missing_required_field_points_at_parent():
    text, _ = _replace("    metric: acceptance_rate", "    # metric removed")
    with pytest.raises(PolicyError) as info:
        load_policy(text, filename="p.yaml")
    (issue,) = [e for e in info.value.errors if e.path == "alerts[0].metric"]
    assert issue.message == "required field is missing"
    assert issue.line == TEMPLATE.splitlines().index("  - name: low") + 1


def test_all_errors_are_collected_not_just_the_first():
    text = TEMPLATE.replace("    method: draft", "    method: x").replace("    severity: warning", "    severity: y")
    text = text.replace("    - weight: 10", "    - weight: -1")
    with pytest.raises(PolicyError) as info:
        load_policy(text)
    paths = {e.path for e in info.value.errors}
    assert {"classes[0].method", "alerts[0].severity", "rollout.steps[0].weight"} <= paths
    assert [e.line for e in info.value.errors] == sorted(e.line for e in info.value.errors)


@pytest.mark.parametrize("text,line,fragment", [
    ("version: 1\nclasses: [\n", 3, "YAML syntax"),
    ("version: 1\nversion: 2\n", 2, "duplicate key 'version'"),
    ("- 1\n- 2\n", 1, "must be a mapping"),
    ("", 1, "empty document"),
    ("a: &x [*x]\n", 1, "recursive document"),
    ("a: [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n", 1, "nests too deeply"),
    ("base: &b {name: x}\nclasses:\n  - <<: *b\n", 3, "merge keys"),
    ("? [1, 2]\n: 3\n", 1, "plain text"),
    ("version: 1\nx: \x07\n", 2, "#x0007 is not allowed"),
    ("version: 1\n5: x\n", 2, "mapping key '5' must be text"),
])
def test_document_level_errors(text, line, fragment):
    with pytest.raises(PolicyError) as info:
        load_policy(text, filename="d.yaml")
    first = info.value.errors[0]
    assert fragment in first.message and first.line == line, str(info.value)


@pytest.mark.parametrize("text", ["a: &a [*a, *a, *a]\n", "a: &a {b: *a, c: [*a, *a]}\n",
                                  "x: &x [&y [*x, *y], *x]\n"])
def test_self_referencing_alias_is_one_error(text):
    with pytest.raises(PolicyError) as info:
        load_policy(text, filename="loop.yaml")
    assert len(info.value.errors) == 1, str(info.value)
    assert "recursive" in info.value.errors[0].message


def test_alias_bomb_is_one_error():
    rows = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        rows.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 9) + "]")
    with pytest.raises(PolicyError) as info:
        load_policy("\n".join(rows) + "\n")
    assert [e.message for e in info.value.errors] == ["document has more than 50000 nodes"]


def test_many_problems_are_capped():
    from specops.policies.loader import MAX_ISSUES

    classes = "".join(f"  - name: c{i}\n    method: bogus{i}\n" for i in range(MAX_ISSUES + 30))
    with pytest.raises(PolicyError) as info:
        load_policy(f"version: 1\ndefault_class: c0\nclasses:\n{classes}")
    errors = info.value.errors
    assert len(errors) == MAX_ISSUES + 1
    assert errors[-1].message.endswith("more problems not shown")
    assert int(errors[-1].message.split()[0]) >= 30


def test_file_source_and_unreadable_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(TEMPLATE)
    assert load_policy(good).version == "v1"
    assert load_policy(str(good)).version == "v1"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary)


def test_numeric_version_is_text_and_format_path():
    p = load_policy("version: 2.1\ndefault_class: a\nclasses: [{name: a}]\n")
    assert p.version == "2.1"
    assert load_policy("version: 2024-06-01\ndefault_class: a\nclasses: [{name: a}]\n").version == "2024-06-01"
    assert format_path(("classes", 0, "gamma", "max")) == "classes[0].gamma.max"
    assert format_path(()) == "<root>"


def test_classify_first_match_wins_and_default():
    p = load_policy(TEMPLATE.replace("        max_prompt_tokens: 100\n",
                                     "        max_prompt_tokens: 100\n      - label: {team: ml}\n"))
    code = p.get_class("code")
    # rule 0 needs prefix AND regex AND label AND 1..100 tokens
    assert p.classify("def f(): import os", {"task": "code"}, 10) is code
    assert p.classify("def f(): import os", {"task": "code"}, 101).name == "chat"
    assert p.classify("def f(): pass", {"task": "code"}, 10).name == "chat"
    assert p.classify("hello", {"team": "ml"}, 5) is code   # rule 1
    assert p.classify("hello", {}, 5).name == "chat"
    assert code.speculates_at(0.7) and not code.speculates_at(1.5)


def test_temperature_rules_match_the_request_temperature_and_never_an_unknown_one():
    p = load_policy(TEMPLATE.replace("classes:\n", "classes:\n  - name: sampled\n    match:\n"
                                     "      - temperature: {min: 0.5, max: 2.0}\n        label: {app: chat}\n", 1))
    assert p.classify("hello", {"app": "chat"}, 5, temperature=1.0).name == "sampled"
    assert p.classify("hello", {"app": "chat"}, 5, temperature=0.5).name == "sampled"  # inclusive bounds
    assert p.classify("hello", {"app": "chat"}, 5, temperature=0.49).name == "chat"
    assert p.classify("hello", {}, 5, temperature=1.0).name == "chat"  # both conditions of the rule must hold
    assert p.classify("hello", {"app": "chat"}, 5).name == "chat"  # temperature unknown: no temperature rule matches
    with pytest.raises(PolicyError, match="min .* must be <= max"):
        load_policy(TEMPLATE.replace("        max_prompt_tokens: 100\n", "        temperature: {min: 1.0, max: 0.5}\n"))
    with pytest.raises(PolicyError, match="turn, temperature"):
        load_policy(TEMPLATE.replace("        max_prompt_tokens: 100\n", "      - {}\n"))


def test_the_default_policy_puts_sampled_requests_and_indented_code_in_their_classes():
    """`bench serve`'s mix under the default policy: sampled requests in `sampled` whatever their
    text; greedy code, most of which starts with a newline or indentation, in `code`; docstring
    prose mostly in `general`."""
    from pathlib import Path

    from specops.bench.suites import HOT_TEMPERATURE, builtin_suite

    p = load_policy(Path(__file__).resolve().parents[2] / "examples" / "policies" / "default.yaml")
    for seed in (0, 1):
        code = [p.classify(q.text, {}, 0, temperature=0.0).name for q in builtin_suite("code", seed=seed)]
        hot = {p.classify(q.text, {}, 0, temperature=HOT_TEMPERATURE).name for q in builtin_suite("code", seed=seed)}
        prose = [p.classify(q.text, {}, 0, temperature=0.0).name for q in builtin_suite("prose", seed=seed)]
        assert code.count("code") >= 0.9 * len(code), code
        assert hot == {"sampled"}
        assert prose.count("general") >= 0.8 * len(prose), prose
    assert p.classify("What is the capital of France?", {}, 8, temperature=0.0).name == "factual"
    assert p.classify("\n    for x in xs:\n        total += x\n", {}, 12, temperature=0.0).name == "code"
    assert p.classify("Once upon a time", {}, 4, temperature=0.0).name == "general"


def test_the_auto_example_is_the_default_policy_with_every_class_on_auto():
    """examples/policies/auto.yaml says it is default.yaml with method auto: the same classes in
    the same order, match rules, temperature ranges, deadlines, adaptation, gamma bounds where
    default has them, alert rules and rollout (it had drifted: no `sampled` class, the old code
    rule and fallback thresholds)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples" / "policies"
    default, auto = load_policy(root / "default.yaml"), load_policy(root / "auto.yaml")
    assert [c.name for c in auto.classes] == [c.name for c in default.classes]
    assert auto.default_class == default.default_class
    same = ("match", "temperature", "deadline_s", "adaptation")
    for a, d in zip(auto.classes, default.classes):
        assert a.method == "auto"
        for field in same:
            assert getattr(a, field) == getattr(d, field), (a.name, field)
        if d.method in ("draft", "ngram"):
            assert a.gamma == d.gamma, a.name
        if d.method == "medusa":
            assert (a.medusa_heads, a.tree_size) == (d.medusa_heads, d.tree_size), a.name
    assert auto.alerts == default.alerts
    assert auto.rollout == default.rollout


def test_policy_built_in_python_still_checks_references():
    from pydantic import ValidationError

    from specops.policies import Policy, RequestClass
    with pytest.raises(ValidationError, match="unknown class 'b'"):
        Policy(version="1", default_class="b", classes=[RequestClass(name="a")])


def test_one_line_text_too_long_for_a_file_name_is_yaml_not_a_path():
    """A one-line source the OS cannot take as a file name (ENAMETOOLONG, NUL) is read as YAML:
    a clear PolicyError naming <string>, never an OSError (found by hypothesis)."""
    import pytest

    from specops.policies import load_policy
    from specops.policies.errors import PolicyError

    for text in ("0" * 30 + "\x80" * 300, "a\x00b"):
        with pytest.raises(PolicyError) as err:
            load_policy(text)
        assert "<string>" in str(err.value)


@pytest.mark.parametrize("spelling", ["off", "Off", "no", "false"])
def test_a_bare_off_method_is_the_method_off(spelling):
    """YAML 1.1 reads `method: off` unquoted as False: it means the method off, as the
    schema's own messages spell it; true stays an error."""
    policy = load_policy(TEMPLATE.replace("    method: draft\n", f"    method: {spelling}\n", 1))
    assert policy.classes[0].method == "off" and not policy.classes[0].speculates_at(0.0)
    with pytest.raises(PolicyError, match="method"):
        load_policy(TEMPLATE.replace("    method: draft\n", "    method: on\n", 1))


def test_the_eagle_method_is_a_gamma_method():
    """``method: eagle`` (the EAGLE feature drafter) validates with its γ bounds; a misspelling
    still fails naming the field and the methods."""
    policy = load_policy(TEMPLATE.replace("    method: draft\n", "    method: eagle\n", 1))
    code = policy.classes[0]
    assert code.method == "eagle" and (code.gamma.initial, code.gamma.min, code.gamma.max) == (4, 1, 8)
    assert code.speculates_at(0.5)
    with pytest.raises(PolicyError, match=r"classes\[0\]\.method.*'ngram', 'eagle', 'auto' or 'off'"):
        load_policy(TEMPLATE.replace("    method: draft\n", "    method: eagel\n", 1))


def test_medusa_classes_default_to_an_exact_lookup_branch_and_may_opt_into_typical_acceptance():
    """``lookup_branch`` defaults to the decoder's usual length and may be 0; ``typical`` (lossy)
    is off unless a Medusa class (or one switched off) sets it."""
    policy = load_policy(TEMPLATE)
    code, chat = policy.classes
    assert (code.lookup_branch, code.typical) == (6, False)
    assert (chat.lookup_branch, chat.typical) == (LOOKUP_BRANCH, False) == (4, False)
    medusa = TEMPLATE.replace("    method: draft\n", "    method: medusa\n", 1)
    on = load_policy(medusa.replace("    typical: false\n", "    typical: true\n").replace(
        "    lookup_branch: 6\n", "    lookup_branch: 0\n"))
    assert (on.classes[0].typical, on.classes[0].lookup_branch) == (True, 0)
    off = load_policy(medusa.replace("    method: medusa\n", "    method: off\n").replace(
        "    typical: false\n", "    typical: true\n"))
    assert off.classes[0].method == "off" and off.classes[0].typical


def test_a_class_leaving_medusa_leaves_its_medusa_knobs_behind():
    from specops.policies.retarget import retarget_policy

    medusa = TEMPLATE.replace("    method: draft\n", "    method: medusa\n", 1).replace(
        "    typical: false\n", "    typical: true\n")
    text, methods = retarget_policy(medusa, ["draft", "ngram"])
    assert methods["code"] == "ngram"
    code = load_policy(text).classes[0]
    assert (code.method, code.typical, code.lookup_branch) == ("ngram", False, LOOKUP_BRANCH)
