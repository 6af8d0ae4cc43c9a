"""The n-gram drafter's corpus store: counting, chains, files, the tokenizer check, and its use by
`NgramIndex`, `Decoder.generate` (exact, greedy only), the engine and `bench decode`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specops.decoder import Decoder
from specops.spec.errors import InvalidRequestError, ModelLoadError
from specops.spec.ngram import NgramIndex
from specops.spec.ngram_store import STORE_FILE, NgramStore, store_in, tokenizer_digest
from tests.decoder import test_medusa_bundled

bundled = test_medusa_bundled.bundled  # the bundled Decoder, module-scoped, on one torch thread

V = 16


def small_store(**kw) -> NgramStore:
    # after (1, 2): 3 four times, 4 once -> 3 with share 0.8; after (1, 2, 3): 5 four times;
    # after (7, 8): 7 twice (below min_count 3); order 1 is not kept
    stream = [1, 2, 3, 5, 6] * 4 + [1, 2, 4, 9] + [7, 8, 7, 8, 7, 8]
    kw = {"orders": (2, 3), "min_count": 3} | kw
    return NgramStore.build(stream, vocab_size=V, **kw)


def test_build_keeps_the_most_frequent_next_token_and_its_share():
    store = small_store()
    assert store.next_token([0, 1, 2]) == (3, pytest.approx(0.8))  # order 3 (0,1,2) unseen: order 2 (1,2)
    assert store.next_token([1, 2, 3]) == (5, pytest.approx(1.0))   # order 3 (1,2,3) seen 4 times
    assert store.next_token([9, 9]) is None
    # (7, 8) -> 7 twice only: below min_count
    assert store.next_token([7, 8]) is None
    lower = small_store(min_count=2)
    assert lower.next_token([7, 8]) == (7, pytest.approx(1.0))


def test_ties_take_the_smaller_token_id():
    store = NgramStore.build([1, 2, 5, 1, 2, 4, 1, 2, 5, 1, 2, 4], vocab_size=V, orders=(2,), min_count=1)
    assert store.next_token([1, 2]) == (4, pytest.approx(0.5))


def test_chain_follows_the_store_until_the_share_product_falls_below_min_prob():
    store = small_store()
    # (1,2) -> 3 (0.8), (2,3) -> 5 (1.0), (3,5) -> 6 (1.0, seen 4 times), (5,6) -> 1 (3 of 3)...
    assert store.chain([1, 2], 3) == [3, 5, 6]
    assert store.chain([1, 2], 0) == []
    assert store.chain([1, 2], 3, min_prob=0.9) == []  # the first share 0.8 is already below
    assert store.chain([9, 9], 4) == []


def test_save_and_load_round_trip(tmp_path):
    store = small_store(tokenizer="abc", meta={"source": "test"})
    path = store.save(tmp_path)
    assert path == tmp_path / STORE_FILE
    again = NgramStore.load(tmp_path)
    assert len(again) == len(store) and again.tokenizer == "abc" and again.meta["source"] == "test"
    for ctx in ([1, 2], [1, 2, 3], [5, 6], [7, 8]):
        assert again.chain(ctx, 4) == store.chain(ctx, 4)
    assert store_in(tmp_path) is not None and store_in(tmp_path / "nothing-here") is None


def test_a_broken_or_foreign_file_is_a_load_error(tmp_path):
    bad = tmp_path / STORE_FILE
    bad.write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError):
        NgramStore.load(bad)
    header = {"format_version": 99, "vocab_size": V, "orders": [2]}
    np.savez(bad, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
    with pytest.raises(ModelLoadError, match="format 99"):
        NgramStore.load(bad)


def test_a_bad_header_value_is_a_load_error_too(tmp_path):
    path = small_store().save(tmp_path)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(bytes(arrays["header"]).decode())
    header["min_prob"] = 5.0
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(path, **arrays)
    with pytest.raises(ModelLoadError, match="min_prob"):
        NgramStore.load(path)


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="outside"):
        NgramStore.build([1, 2, 99], vocab_size=V)
    with pytest.raises(ValueError, match="min_count"):
        NgramStore.build([1, 2, 3], vocab_size=V, min_count=0)
    with pytest.raises(ValueError, match="63-bit"):
        NgramStore.build([1, 2, 3], vocab_size=1 << 20, orders=(4,))


def test_index_drafts_the_store_chain_only_without_a_longer_context_match():
    store = small_store()
    index = NgramIndex(store=store)
    index.extend([1, 2])  # no earlier occurrence of anything: the store's chain
    assert index.propose(4, by_match=True) == [3, 5, 6, 1]
    assert index.store_drafts == 1
    # a 3-token context match: the context's own continuation, whatever the store says
    index = NgramIndex(store=store)
    index.extend([1, 2, 4, 9, 9, 1, 2, 4])
    assert index.propose(4, by_match=True) == [9, 9, 1, 2]
    assert index.store_drafts == 0
    # without a store nothing is drafted where the context has no match
    plain = NgramIndex()
    plain.extend([1, 2])
    assert plain.propose(4, by_match=True) == []


def test_the_bundled_target_ships_a_store_for_its_tokenizer(bundled):
    assert bundled.ngram_store is not None and len(bundled.ngram_store) > 10_000
    assert bundled.ngram_store.tokenizer == tokenizer_digest(bundled.tokenizer)
    assert bundled.ngram_store.vocab_size == bundled.target.vocab_size


def test_a_store_for_another_tokenizer_or_vocabulary_is_refused(bundled):
    other = NgramStore.build([1, 2, 3, 1, 2, 3], vocab_size=bundled.target.vocab_size, orders=(2,), min_count=1,
                             tokenizer="0123456789abcdef")
    with pytest.raises(InvalidRequestError, match="another tokenizer"):
        Decoder(bundled.target, tokenizer=bundled.tokenizer, ngram_store=other)
    small = NgramStore.build([1, 2, 3], vocab_size=V, orders=(2,), min_count=1)
    with pytest.raises(InvalidRequestError, match="vocabulary of 16"):
        Decoder(bundled.target, tokenizer=bundled.tokenizer, ngram_store=small)
    with pytest.raises(InvalidRequestError, match="NgramStore"):
        Decoder(bundled.target, ngram_store="store.npz")


def _code_prompts(dec: Decoder, count: int) -> list[list[int]]:
    from specops.train.data import code_prompts, split_stdlib

    texts = code_prompts(split_stdlib().heldout_files, count=count, max_chars=300, seed=11)
    return [dec.tokenizer.encode(t) for t in texts]


def test_greedy_ngram_with_the_store_is_exact_and_drafts_from_it(bundled):
    used = forwards_with = forwards_without = 0
    for prompt in _code_prompts(bundled, 4):
        want = bundled.generate(prompt, method="ar", max_new_tokens=48).tokens
        with_store = bundled.generate(prompt, method="ngram", max_new_tokens=48)
        without = bundled.generate(prompt, method="ngram", max_new_tokens=48, corpus=False)
        assert with_store.tokens == want and without.tokens == want
        assert without.stats.store_drafts == 0
        used += with_store.stats.store_drafts
        forwards_with += with_store.stats.target_forwards
        forwards_without += without.stats.target_forwards
    assert used > 0
    assert forwards_with < forwards_without  # the store's drafts were accepted: fewer verify forwards
    with pytest.raises(InvalidRequestError, match="corpus"):
        bundled.generate([1, 2, 3], method="ngram", corpus="yes")


def test_sampled_requests_draft_from_their_own_context_only(bundled):
    prompt = _code_prompts(bundled, 1)[0]
    out = bundled.generate(prompt, method="ngram", max_new_tokens=32, temperature=1.0, seed=3)
    assert out.stats.store_drafts == 0


def test_the_engine_drafts_greedy_ngram_requests_from_the_store(bundled, monkeypatch):
    from specops.engine.engine import Engine
    from specops.engine.sequence import SamplingParams, SpecSettings
    from tests.serving.test_engine import full_speculation

    calls = []
    real = NgramStore.chain

    def counting(self, context, count, min_prob=None):
        out = real(self, context, count, min_prob)
        calls.append(len(out))
        return out

    monkeypatch.setattr(NgramStore, "chain", counting)
    eng = full_speculation(Engine(bundled, max_batch=4, kv_cache_mb=16))
    prompts = _code_prompts(bundled, 2)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add(f"r{i}", p, SamplingParams(max_tokens=32), SpecSettings(method="ngram", gamma=4))
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    monkeypatch.setattr(NgramStore, "chain", real)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == bundled.generate(p, method="ar", max_new_tokens=32).tokens
    assert any(calls)  # the store proposed tokens


def test_bench_ngram_prompt_runs_ngram_without_the_store(bundled):
    from specops.bench.peers import DecoderMethod

    prompt = _code_prompts(bundled, 1)[0]
    run = DecoderMethod("ngram-prompt", bundled).run(prompt, max_new_tokens=24, temperature=0.0, seed=0)
    assert run.tokens == bundled.generate(prompt, method="ar", max_new_tokens=24).tokens
    assert run.drafted is not None  # counted as a speculative method


def test_train_ngram_store_command_writes_a_loadable_store(tmp_path, bundled):
    from specops.assets import TARGET_DIR
    from specops.train.cli_store import train_store_command

    data = tmp_path / "corpus.py"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 50)
    res = CliRunner().invoke(train_store_command, ["--model", str(TARGET_DIR), "--data", str(data),
                                                   "--min-count", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["entries"]["3"] > 0 and summary["out"] == str(tmp_path / STORE_FILE)
    store = NgramStore.load(tmp_path)
    assert store.tokenizer == tokenizer_digest(bundled.tokenizer)
    ids = bundled.tokenizer.encode("def add(a, b):\n    return")
    assert store.chain(ids, 4)  # the corpus's own continuation
    bad = CliRunner().invoke(train_store_command, ["--model", str(TARGET_DIR), "--orders", "2,x",
                                                   "--data", str(data), "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "--orders" in bad.output
    neither = CliRunner().invoke(train_store_command, ["--model", str(TARGET_DIR), "--out", str(tmp_path)])
    assert neither.exit_code != 0 and "--stdlib" in neither.output
