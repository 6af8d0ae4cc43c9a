"""The chat-model suites: counts, classes, temperatures, the model's chat template applied."""

from __future__ import annotations

from collections import Counter

import pytest

from specops.bench import chat_prompts
from specops.bench.chat_suite import (CHAT_MODEL_CLASSES, CREATIVE_TEMPERATURE, TURN_KINDS, chat_model_suite,
                                      prompt_class)
from specops.bench.suites import SUITES, SuiteError, builtin_suite

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """The bundled tokenizer given a chat template (as an instruction-tuned model's has)."""
    from transformers import AutoTokenizer

    from specops.assets import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def plain_tokenizer():
    from transformers import AutoTokenizer

    from specops.assets import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_each_class_has_forty_distinct_prompts_with_its_temperature(chat_tokenizer):
    for name in CHAT_MODEL_CLASSES:
        prompts = chat_model_suite(name, chat_tokenizer)
        assert len(prompts) >= 40, name
        assert len({p.text for p in prompts}) == len(prompts), name
        assert {p.temperature for p in prompts} == ({CREATIVE_TEMPERATURE} if name == "creative" else {0.0}), name
        assert {prompt_class(p.kind) for p in prompts} == {name}
    assert CREATIVE_TEMPERATURE == 0.8


def test_multi_turn_chat_prompts_carry_the_conversation_so_far(chat_tokenizer):
    prompts = chat_model_suite("chat", chat_tokenizer)
    assert Counter(p.kind for p in prompts) == {k: len(chat_prompts.CONVERSATIONS) for k in TURN_KINDS}
    first = chat_prompts.CONVERSATIONS[0]
    turn1, turn2, turn3 = prompts[:3]
    assert turn1.text == f"[user]{first[0]}[/][assistant]"
    assert turn2.text == f"[user]{first[0]}[/][assistant]{first[1]}[/][user]{first[2]}[/][assistant]"
    assert turn3.text.startswith(turn2.text[: -len("[assistant]")]) and turn3.text.endswith(f"{first[4]}[/][assistant]")


def test_every_prompt_is_rendered_with_the_model_chat_template(chat_tokenizer):
    for p in chat_model_suite("mixed", chat_tokenizer):
        assert p.text.startswith("[user]") and p.text.endswith("[/][assistant]")
    code = chat_model_suite("code", chat_tokenizer)
    assert code[0].text == f"[user]{chat_prompts.CODE[0]}[/][assistant]"


def test_mixed_covers_all_four_classes_interleaved(chat_tokenizer):
    mixed = chat_model_suite("mixed", chat_tokenizer)
    total = sum(len(chat_model_suite(c, chat_tokenizer)) for c in CHAT_MODEL_CLASSES)
    assert len(mixed) == total >= 160
    assert [prompt_class(p.kind) for p in mixed[:8]] == list(CHAT_MODEL_CLASSES) * 2  # --limit keeps the mix
    classes = Counter(prompt_class(p.kind) for p in mixed)
    assert set(classes) == set(CHAT_MODEL_CLASSES) and min(classes.values()) >= 40
    assert all(p.temperature == (CREATIVE_TEMPERATURE if p.kind == "creative" else 0.0) for p in mixed)


def test_a_chat_template_picks_the_chat_model_suites_and_its_absence_keeps_the_stdlib_ones(chat_tokenizer,
                                                                                          plain_tokenizer):
    assert {"qa", "creative"} <= set(SUITES)
    for name in ("chat", "code", "mixed"):
        assert builtin_suite(name, tokenizer=chat_tokenizer) == chat_model_suite(name, chat_tokenizer)
    stdlib_code = builtin_suite("code", tokenizer=plain_tokenizer)
    assert stdlib_code == builtin_suite("code") and not stdlib_code[0].text.startswith("User:")
    assert {p.kind for p in builtin_suite("mixed", tokenizer=plain_tokenizer)} == {"code", "prose", "hot"}


def test_qa_and_creative_without_a_chat_template_use_the_servers_plain_transcript(plain_tokenizer):
    qa = builtin_suite("qa", tokenizer=plain_tokenizer)
    assert qa[0].text == f"User: {chat_prompts.QA[0]}\nAssistant:"
    creative = builtin_suite("creative")
    assert creative[0].text == f"User: {chat_prompts.CREATIVE[0]}\nAssistant:"
    assert builtin_suite("qa", chat_template="<{role}>{content}\n")[0].text == f"<user>{chat_prompts.QA[0]}\n<assistant>"
    with pytest.raises(SuiteError, match="exactly one"):
        builtin_suite("qa", chat_template="{content}")


def test_bench_decode_draws_the_suite_from_the_models_tokenizer():
    """run_benchmark hands the model's tokenizer to the suite: a chat template switches to chat-model prompts."""
    from specops.bench.decode import BenchConfig, load_models, run_benchmark

    cfg = BenchConfig(suite="mixed", methods=["ar"], max_new_tokens=2, repeats=1, limit=4, progress=False)
    models = load_models(cfg)
    models.tokenizer.chat_template = TEMPLATE
    report = run_benchmark(cfg, models=models)
    assert set(report["prompt_kinds"]) == {"turn1", "code", "qa", "creative"}


def test_kind_table_lists_turns_then_classes_then_other_kinds():
    from specops.bench.chat_suite import format_kind_table

    row = {"tokens_per_s": 10.0, "acceptance_rate": 0.5, "mean_accepted_len": 1.5}
    kinds = ["creative", "hot", "qa", "turn2", "code", "turn1"]
    report = {"prompt_kinds": sorted(kinds), "results": [{"method": "ngram", "by_kind": {k: row for k in kinds}}]}
    lines = format_kind_table(report).splitlines()
    assert lines[0].split()[:2] == ["method", "kind"]
    assert [line.split()[1] for line in lines[2:]] == ["turn1", "turn2", "code", "qa", "creative", "hot"]
