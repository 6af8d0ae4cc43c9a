"""`specops demo` prints the decoding table: every method, exact, and the ops summary."""

from __future__ import annotations

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
