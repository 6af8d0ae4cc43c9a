"""The multi-turn chat benchmark suite: conversations, templates and per-turn kinds."""

from __future__ import annotations

import pytest

from specops.bench.chat_suite import ChatTemplate, ChatTemplateError, chat_conversations, format_turn_table, turn_prompts
from specops.bench.suites import SuiteError, builtin_suite
from specops.policies.turns import turn_from_messages


def test_template_renders_conversation_and_generation_prompt():
    t = ChatTemplate("[{role}] {content}\n")
    assert t.render([("user", "hi")]) == "[user] hi\n[assistant] "
    conv = chat_conversations(["a\n", "b", "c", "d", "e", "f"], turns=2)
    assert conv == [[("user", "a"), ("assistant", "b"), ("user", "c")], [("user", "d"), ("assistant", "e"), ("user", "f")]]
    prompts = turn_prompts(conv[0], t)
    assert prompts == [(1, "[user] a\n[assistant] "), (2, "[user] a\n[assistant] b\n[user] c\n[assistant] ")]
    # the suite's turn agrees with the serving-side definition
    assert prompts[1][0] == turn_from_messages([{"role": r, "content": c} for r, c in conv[0]])
    for bad in ("{content}", "{role}", "{content}{role}", "{role}{role}{content}"):
        with pytest.raises(ChatTemplateError):
            ChatTemplate(bad)


def test_builtin_chat_suite_has_every_turn_and_grows_by_turn():
    prompts = builtin_suite("chat", chat_conversations=2, chat_turns=4)
    assert [p.kind for p in prompts] == ["turn1", "turn2", "turn3+", "turn3+"] * 2
    for conv in (prompts[:4], prompts[4:]):
        for earlier, later in zip(conv, conv[1:]):
            assert later.text.startswith(earlier.text) and len(later.text) > len(earlier.text)
    assert all(p.temperature == 0 and p.text.endswith("<|assistant|>\n") for p in prompts)
    with pytest.raises(SuiteError, match="exactly one"):
        builtin_suite("chat", chat_template="{content}")


def test_turn_table_lists_each_turn():
    report = {"prompt_kinds": ["turn1", "turn2"], "results": [
        {"method": "draft", "by_kind": {"turn1": {"tokens_per_s": 50.0, "acceptance_rate": 0.8, "mean_accepted_len": 3.1},
                                        "turn2": {"tokens_per_s": 40.0, "acceptance_rate": None, "mean_accepted_len": 1.0}}}]}
    lines = format_turn_table(report).splitlines()
    assert "turn1" in lines[2] and "0.800" in lines[2] and "turn2" in lines[3] and lines[3].split()[3] == "-"
