"""`specops.train.self_distill`: the target's own prompts, replies and states for drafter training."""

from __future__ import annotations

import functools

import pytest
import torch

from specops.decoder import Decoder
from specops.train import self_distill
from specops.train.self_distill import ReplyWriter, self_prompts, teacher_forced, user_turn_prefix


@functools.lru_cache(maxsize=1)
def bundled_decoder() -> Decoder:
    torch.set_num_threads(1)
    return Decoder.from_pretrained("bundled")


def _prompts(dec: Decoder, count: int) -> list[list[int]]:
    texts = ["def parse(self, text):\n    ", "import os\nimport sys\n\n", "class Reader:\n    def __init__(self",
             "for key, value in items:\n", "    return [x for x in", "with open(path) as f:\n"]
    return [dec.tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts)), add_special_tokens=False)
            for i in range(count)]


def test_the_first_pass_writes_the_targets_own_greedy_replies():
    dec = bundled_decoder()
    prompts = _prompts(dec, 5)
    writer = ReplyWriter(dec, prompts, new_tokens=12, temperature=0.8, max_batch=3, eos=None)
    wave = writer.wave(budget_s=120.0, size=5)
    assert [r.prompt for r in wave] == [0, 1, 2, 3, 4] and not any(r.sampled for r in wave)
    for r in wave:
        ref = dec.generate(prompts[r.prompt], method="ar", max_new_tokens=12).tokens
        assert r.tokens == prompts[r.prompt] + ref
    again = writer.wave(budget_s=120.0, size=5)  # the second pass repeats the prompts, sampled
    assert [r.prompt for r in again] == [0, 1, 2, 3, 4] and all(r.sampled for r in again)
    assert all(len(r.tokens) == len(prompts[r.prompt]) + 12 for r in again)
    assert any(a.tokens != b.tokens for a, b in zip(wave, again))


def test_a_wave_stops_at_its_token_goal_and_keeps_what_was_written():
    dec = bundled_decoder()
    prompts = _prompts(dec, 6)
    writer = ReplyWriter(dec, prompts, new_tokens=40, temperature=0.8, max_batch=2, eos=None)
    goal = sum(len(p) for p in prompts[:2]) + 20
    wave = writer.wave(budget_s=120.0, size=6, token_goal=goal)
    assert 1 <= len(wave) < 6  # the rest never started
    for r in wave:  # a cut reply is a prefix of the full greedy reply
        ref = dec.generate(prompts[r.prompt], method="ar", max_new_tokens=40).tokens
        new = r.tokens[len(prompts[r.prompt]):]
        assert new and new == ref[: len(new)]
    assert ReplyWriter(dec, [[5]], new_tokens=4, temperature=0.8).wave(budget_s=10.0) == []  # 1-token prompts skipped


def test_teacher_forced_states_match_token_by_token_decoding():
    dec = bundled_decoder()
    runner = dec.target
    tokens = _prompts(dec, 1)[0] + [17, 23, 5, 99]
    features, labels = teacher_forced(runner, tokens)
    assert features.shape == (len(tokens), runner.model.config.hidden_size) and features.dtype == torch.bfloat16
    runner.reset(1)
    with torch.inference_mode():
        rows, choices = [], []
        for t in tokens:
            o = runner.forward(torch.tensor([[t]]), need_hidden=True)
            rows.append(o.hidden[0, -1])
            choices.append(int(o.logits[0, -1].argmax()))
    torch.testing.assert_close(features.float(), torch.stack(rows).float(), atol=0.05, rtol=0.02)
    assert labels.tolist() == choices


class _ChatTokenizer:
    """A tokenizer stand-in with a chat template and a system prompt."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "<system>be brief</system>" + "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 + 2 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_user_turn_prefix_is_the_template_up_to_the_users_words():
    assert user_turn_prefix(_ChatTokenizer()) == "<system>be brief</system><user>"
    assert user_turn_prefix(bundled_decoder().tokenizer) is None  # no chat template: no self-written prompts


def test_self_prompts_keep_distinct_messages_the_model_ended_itself(monkeypatch):
    written = iter([
        {0: ([ord(c) for c in "How do tides work?"], "stop"),
         1: ([ord(c) for c in "Short"], "stop"),  # too short
         2: ([ord(c) for c in "A message cut by its length limit"], "length"),  # not ended by the model
         3: ([ord(c) for c in "how do  tides work?"], "stop")},  # the same message
        {0: ([ord(c) for c in "Write a haiku about rain."], "stop"),
         1: ([ord(c) for c in "Explain recursion simply."], "stop")},
    ])
    seen_requests = []

    def fake_run(engine, requests, **kwargs):
        seen_requests.append(requests)
        return next(written)

    monkeypatch.setattr(self_distill, "run_batch", fake_run)
    monkeypatch.setattr(self_distill, "engine_for", lambda *a, **k: object())
    out = self_prompts(object(), _ChatTokenizer(), 2, budget_s=60.0, max_batch=2, progress=False)
    assert out == ["How do tides work?", "Write a haiku about rain."]
    prefix_ids = _ChatTokenizer().encode("<system>be brief</system><user>")
    params = seen_requests[0][0][1]
    assert all(ids == prefix_ids for ids, _ in seen_requests[0])
    assert params.temperature == self_distill.SELF_PROMPT_TEMPERATURE and params.max_tokens > 0
    assert len({p.seed for _, p in seen_requests[0]}) == len(seen_requests[0])  # each draw its own seed
    assert self_prompts(object(), bundled_decoder().tokenizer, 5, progress=False) == []


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_train_config_refuses_bad_self_prompt_counts(bad):
    from specops.train.eagle import EagleTrainConfig

    with pytest.raises(ValueError, match="self_prompts"):
        EagleTrainConfig(self_prompts=bad).validate()
