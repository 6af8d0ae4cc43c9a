"""`specops policy classify`: the class and rule a request lands in, as the server decides it."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from specops.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
DEFAULT = str(EXAMPLES / "default.yaml")


def run(*args: str):
    return CliRunner().invoke(main, ["policy", "classify", *args])


def test_one_line_per_prompt_with_the_rule_that_matched():
    res = run(DEFAULT, "\n    for x in xs:\n        total += x\n", "Once upon a time", "--temperature", "0")
    assert res.exit_code == 0, res.output
    code, general = res.output.splitlines()
    assert code.split()[:4] == ["code", "rule", "2", "(regex)"] and "t=0" in code
    assert general.split()[:3] == ["general", "default", "class"] and "plainly" not in general
    labelled = run(DEFAULT, "x", "--temperature", "0", "--label", "task=code")
    assert labelled.output.split()[:4] == ["code", "rule", "3", "(label)"], labelled.output


def test_temperature_decides_and_an_omitted_one_is_openais_1():
    res = run(DEFAULT, "def f(x):")  # no --temperature: 1.0, as a request that omits it
    assert res.exit_code == 0, res.output
    assert res.output.split()[:4] == ["sampled", "rule", "1", "(temperature)"]
    hot = run(DEFAULT, "def f(x):", "--temperature", "1.5")
    assert hot.output.startswith("sampled") and "[decodes plainly at this temperature]" in hot.output
    greedy = json.loads(run(DEFAULT, "def f(x):", "--temperature", "0", "--json").output)
    assert greedy == {"class": "code", "rule": 1, "speculates": True, "temperature": 0.0}


def test_turns_from_the_option_or_the_file():
    chat = str(EXAMPLES / "chat.yaml")
    assert run(chat, "hello there", "--turn", "2", "--temperature", "0").output.startswith("chat-followup")
    assert run(chat, "hello there", "--temperature", "0").output.startswith("chat ")  # turn unknown


def test_a_prompts_file_prints_requests_per_class_by_kind_and_rule(tmp_path):
    rows = ([{"prompt": "\n    return x\n", "temperature": 0, "kind": "code"}] * 3
            + [{"prompt": "\n    return x\n", "temperature": 1.0, "kind": "hot"}] * 2
            + [{"prompt": "    \"\"\"Docs for it.", "temperature": 0, "kind": "prose"}]
            + [{"prompt": "hi", "temperature": 0, "labels": {"task": "code"}}])
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    res = run(DEFAULT, "--prompts", str(path))
    assert res.exit_code == 0, res.output
    table = {line.split()[0]: line for line in res.output.splitlines()[1:-1]}
    assert list(table) == ["sampled", "code", "factual", "general"]  # policy order, empty classes too
    assert table["sampled"].split()[1:3] == ["2", "29%"] and "hot 2 / rule 1 2" in table["sampled"]
    assert table["code"].split()[1] == "4" and "code 3 / rule 2 3, rule 3 1" in table["code"]
    assert table["factual"].split()[1:3] == ["0", "0%"]
    assert "prose 1 / default class 1" in table["general"]
    assert res.output.splitlines()[-1].startswith("7 requests")
    counts = json.loads(run(DEFAULT, "--prompts", str(path), "--json").output)
    assert counts == {"requests": 7, "classes": {"sampled": 2, "code": 4, "factual": 0, "general": 1}}
    text = tmp_path / "lines.txt"
    text.write_text("def f():\nOnce upon a time\n")
    by_line = json.loads(run(DEFAULT, "--prompts", str(text), "--temperature", "0", "--json").output)
    assert by_line["classes"] == {"sampled": 0, "code": 1, "factual": 0, "general": 1}


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    neither = run(DEFAULT)
    assert neither.exit_code == 2 and "give PROMPTS or --prompts FILE" in neither.output
    both = run(DEFAULT, "x", "--prompts", str(tmp_path / "p.jsonl"))
    assert both.exit_code == 2 and "one of the two" in both.output
    label = run(DEFAULT, "x", "--label", "novalue")
    assert label.exit_code == 2 and "expected KEY=VALUE" in label.output
    assert run(DEFAULT, "x", "--temperature", "3").exit_code == 2
    missing = run(DEFAULT, "--prompts", str(tmp_path / "nope.jsonl"))
    assert missing.exit_code == 1 and "prompts file not found" in missing.output
    for body, message in [('{"prompt": "a"}\n{bad\n', "p.jsonl:2: invalid JSON"),
                          ('{"text": "a"}\n', "p.jsonl:1: each line needs a non-empty string field 'prompt'"),
                          ('{"prompt": "a", "temperature": 9}\n', "p.jsonl:1: temperature must be a number in [0, 2]"),
                          ('{"prompt": "a", "temperature": true}\n', "temperature must be a number"),
                          ('{"prompt": "a", "labels": {"k": 1}}\n', "labels must be an object of string values"),
                          ('{"prompt": "a", "turn": 0}\n', "turn must be an integer >= 1"),
                          ("\n\n", "no prompts in")]:
        bad = tmp_path / "p.jsonl"
        bad.write_text(body)
        res = run(DEFAULT, "--prompts", str(bad))
        assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, (body, res.output)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in run(DEFAULT, "--prompts", str(binary)).output
    policy = tmp_path / "broken.yaml"
    policy.write_text("version: v\ndefault_class: a\nclasses:\n  - name: a\n    match:\n      - temperature: {min: 2, max: 1}\n")
    res = run(str(policy), "x")
    assert res.exit_code == 1 and "broken.yaml:6" in res.output and "must be <= max" in res.output, res.output
