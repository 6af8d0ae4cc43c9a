"""The public `Decoder` API: loading, dispatch, bad input, fallback, stats → telemetry records."""

from __future__ import annotations

import warnings

import pytest
import torch

from specops.decoder import (
    ContextLengthError,
    Decoder,
    GenerateOutput,
    InvalidRequestError,
    MissingComponentError,
    ModelLoadError,
    UnknownMethodError,
    VocabMismatchError,
)
from specops.decoder.api import METHODS
from tests.decoder.tiny_models import VOCAB, hf_greedy, perturbed, tiny_gpt2, tiny_llama


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=31, max_positions=64)
    return target, perturbed(target, noise=0.05, seed=32)


@pytest.fixture(scope="module")
def dec(models):
    target, draft = models
    return Decoder(target, draft=draft)


PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 7, 9]


def test_generate_returns_new_tokens_and_stats(dec, models):
    ref = hf_greedy(models[0], PROMPT, 12)
    for method in ("ar", "draft", "ngram"):
        out = dec.generate(PROMPT, method=method, max_new_tokens=12)
        assert isinstance(out, GenerateOutput)
        assert out.tokens == ref and out.stats.method == method and out.stats.new_tokens == 12
        assert out.stats.stop_reason == "max_new_tokens"
        assert out.text is None  # no tokenizer given


def test_prompt_forms_are_equivalent(dec):
    a = dec.generate(PROMPT, max_new_tokens=5).tokens
    assert dec.generate(torch.tensor(PROMPT), max_new_tokens=5).tokens == a
    assert dec.generate(torch.tensor([PROMPT]), max_new_tokens=5).tokens == a
    assert dec.generate(tuple(PROMPT), max_new_tokens=5).tokens == a


@pytest.mark.parametrize(
    "prompt, kwargs, error, needle",
    [
        ([], {}, InvalidRequestError, "prompt is empty"),
        (torch.tensor([], dtype=torch.long), {}, InvalidRequestError, "prompt is empty"),
        ([1] * 64, {}, ContextLengthError, "longer than the model's context"),
        ([1] * 200, {"method": "draft"}, ContextLengthError, "64 positions"),
        (PROMPT, {"temperature": -1.0}, InvalidRequestError, "temperature must be >= 0"),
        (PROMPT, {"temperature": 1.0, "top_p": 0.0}, InvalidRequestError, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"temperature": 1.0, "top_p": 1.01}, InvalidRequestError, "top_p"),
        (PROMPT, {"temperature": 1.0, "top_k": 0}, InvalidRequestError, "top_k"),
        (PROMPT, {"method": "draft", "gamma": 0}, InvalidRequestError, "gamma must be >= 1"),
        (PROMPT, {"method": "draft", "gamma_min": 5, "gamma_max": 2}, InvalidRequestError, "gamma_min"),
        (PROMPT, {"method": "beam"}, UnknownMethodError, "unknown method 'beam'"),
        (PROMPT, {"method": "draft", "schedule": "fast"}, InvalidRequestError, "unknown schedule"),
        (PROMPT, {"max_new_tokens": 0}, InvalidRequestError, "max_new_tokens"),
        ([1, VOCAB], {}, InvalidRequestError, f"token id {VOCAB} is outside the vocabulary"),
        ([1, -3], {}, InvalidRequestError, "outside the vocabulary"),
        (torch.tensor([1.0, 2.0]), {}, InvalidRequestError, "integer token ids"),
        (torch.ones(2, 3, dtype=torch.long), {}, InvalidRequestError, "1-D"),
        ("def f():", {}, InvalidRequestError, "needs a tokenizer"),
        ([1, "2"], {}, InvalidRequestError, "must hold ints"),
        (PROMPT, {"eos_token_id": "x"}, InvalidRequestError, "eos_token_id"),
        (PROMPT, {"seed": 1.5, "temperature": 1.0}, InvalidRequestError, "seed"),
    ],
)
def test_bad_input_is_a_clear_error(dec, prompt, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        dec.generate(prompt, **kwargs)


def test_unknown_method_error_lists_the_methods(dec):
    with pytest.raises(UnknownMethodError) as info:
        dec.generate(PROMPT, method="magic")
    for name in METHODS:
        assert name in str(info.value)


def test_draft_method_without_draft_is_an_error(models):
    with pytest.raises(MissingComponentError, match="needs a draft model|needs draft"):
        Decoder(models[0]).generate(PROMPT, method="draft")


def test_vocabulary_mismatch_is_an_error_naming_both_sizes(models):
    other = tiny_gpt2(seed=33, vocab=VOCAB + 8)
    with pytest.raises(VocabMismatchError, match=rf"{VOCAB + 8} tokens.*{VOCAB} tokens"):
        Decoder(models[0], draft=other)


def test_vocabulary_mismatch_with_fallback_warns_and_decodes_plainly(models):
    other = tiny_gpt2(seed=33, vocab=VOCAB + 8)
    with pytest.warns(RuntimeWarning, match="falls back to plain decoding"):
        dec = Decoder(models[0], draft=other, fallback=True)
    out = dec.generate(PROMPT, method="draft", max_new_tokens=6)
    assert out.stats.method == "ar" and out.stats.fallback_reason == "draft_unavailable"
    assert out.tokens == hf_greedy(models[0], PROMPT, 6)


def test_a_draft_no_runner_can_run_is_a_load_error_or_a_fallback(models):
    with pytest.raises(ModelLoadError, match="cannot use the draft model"):
        Decoder(models[0], draft=object())
    with pytest.warns(RuntimeWarning, match="falls back"):
        dec = Decoder(models[0], draft=object(), fallback=True)
    assert dec.generate(PROMPT, method="draft", max_new_tokens=3).stats.fallback_reason == "draft_unavailable"


def test_from_pretrained_loads_target_and_draft_from_folders(tmp_path, models):
    target, draft = models
    target.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    dec = Decoder.from_pretrained(tmp_path / "t", draft=str(tmp_path / "d"))
    ref = hf_greedy(target, PROMPT, 8)
    assert dec.generate(PROMPT, method="draft", max_new_tokens=8).tokens == ref
    assert dec.tokenizer is None


def test_from_pretrained_draft_that_cannot_load(tmp_path, models):
    models[0].save_pretrained(tmp_path / "t")
    missing = tmp_path / "no-such-draft"
    with pytest.raises(ModelLoadError, match="draft model"):
        Decoder.from_pretrained(tmp_path / "t", draft=missing)
    with pytest.warns(RuntimeWarning, match="falls back"):
        dec = Decoder.from_pretrained(tmp_path / "t", draft=missing, fallback=True)
    out = dec.generate(PROMPT, method="draft", max_new_tokens=4)
    assert out.stats.fallback_reason == "draft_unavailable" and len(out.tokens) == 4
    with pytest.raises(ModelLoadError, match="target model"):
        Decoder.from_pretrained(missing)


def test_seed_makes_sampling_reproducible(dec):
    kw = dict(method="draft", temperature=1.0, top_k=20, max_new_tokens=16)
    a = dec.generate(PROMPT, seed=5, **kw).tokens
    assert dec.generate(PROMPT, seed=5, **kw).tokens == a
    assert any(dec.generate(PROMPT, seed=s, **kw).tokens != a for s in (6, 7, 8))


def test_eos_list_and_stop_reason(dec):
    full = dec.generate(PROMPT, max_new_tokens=12).tokens
    eos = full[4]
    out = dec.generate(PROMPT, method="draft", max_new_tokens=12, eos_token_id=[eos, VOCAB - 1])
    assert out.tokens == full[: full.index(eos) + 1] and out.stats.stop_reason == "eos"


def test_stats_become_a_telemetry_record(dec):
    out = dec.generate(PROMPT, method="draft", max_new_tokens=12, gamma=3)
    assert out.stats.plain_token_s is not None and out.stats.plain_token_s > 0  # calibrated once
    rec = out.stats.to_record("code", pod="pod-a")
    from specops.telemetry import DecodeRecord

    assert isinstance(rec, DecodeRecord)
    assert (rec.method, rec.request_class, rec.new_tokens) == ("draft", "code", 12)
    assert rec.drafted == out.stats.drafted and rec.accepted == out.stats.accepted
    assert rec.accepted_per_pos == out.stats.accepted_per_pos and rec.gamma == 3 == out.stats.gamma
    assert rec.plain_s_estimate == pytest.approx(12 * out.stats.plain_token_s)
    assert len(rec.token_latencies_s) == 12 and rec.heads == 0
    ar = dec.generate(PROMPT, method="ar", max_new_tokens=4).stats.to_record("chat")
    assert ar.gamma == 0 and ar.drafted == 0 and ar.target_forwards == 4


def test_runners_can_be_passed_directly(models):
    from specops.models.loading import load_runner

    target, draft = models
    dec = Decoder(load_runner(target, impl="hf"), draft=load_runner(draft, impl="fast"))
    assert dec.generate(PROMPT, method="draft", max_new_tokens=6).tokens == hf_greedy(target, PROMPT, 6)


def test_bad_impl_and_bad_model_objects(models):
    with pytest.raises(InvalidRequestError, match="impl"):
        Decoder(models[0], impl="turbo")
    with pytest.raises(TypeError, match="transformers causal LM or a ModelRunner"):
        Decoder(object())


def test_bundled_decoder_generates_text():
    """The shipped pair loads by name, with its tokenizer, and speculation matches plain decoding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec = Decoder.from_pretrained("bundled")
    assert dec.draft is not None and dec.tokenizer is not None
    prompt = "def fibonacci(n):\n    "
    plain = dec.generate(prompt, max_new_tokens=16)
    spec = dec.generate(prompt, method="draft", max_new_tokens=16)
    assert spec.tokens == plain.tokens and isinstance(spec.text, str) and spec.text


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_deadline_turns_speculation_into_plain_decoding_exactly(dec, models, method):
    ref = hf_greedy(models[0], PROMPT, 10)
    late = dec.generate(PROMPT, method=method, max_new_tokens=10, deadline_s=1e-9)
    assert late.tokens == ref
    assert late.stats.fallback_reason == "deadline" and late.stats.drafted == 0
    assert late.stats.target_forwards == 1 + 10  # prefill, then one plain step per token
    on_time = dec.generate(PROMPT, method=method, max_new_tokens=10, deadline_s=3600.0)
    assert on_time.tokens == ref and on_time.stats.fallback_reason is None


@pytest.mark.parametrize("kwargs, needle", [
    ({"deadline_s": 0}, "deadline_s"),
    ({"deadline_s": -1.0}, "deadline_s"),
    ({"method": "ngram", "max_ngrams": 4}, "unknown option.*max_ngrams.*allowed: by_match, corpus, max_ngram, min_ngram"),
    ({"method": "draft", "max_ngram": 4}, "unknown option.*for method 'draft'"),
])
def test_bad_deadline_and_unknown_options(dec, kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        dec.generate(PROMPT, **kwargs)


def test_ngram_options_reach_the_drafter(dec, models):
    out = dec.generate([5, 6, 7, 8, 5, 6, 7], method="ngram", max_new_tokens=6, max_ngram=1, min_ngram=1)
    assert out.tokens == hf_greedy(models[0], [5, 6, 7, 8, 5, 6, 7], 6)
