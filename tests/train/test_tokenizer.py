from __future__ import annotations

import pytest

from specops.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from tests.train.tiny_assets import CORPUS, tiny_tokenizer


def test_round_trip_is_exact_for_code_and_unusual_bytes(tmp_path):
    tok = tiny_tokenizer()
    save_tokenizer(tok, tmp_path)
    loaded = load_tokenizer(tmp_path)  # through AutoTokenizer
    samples = [
        "def f(x):\n\treturn  x ** 2  # trailing  spaces   \n",
        "unicode: ü € 漢字 \U0001f600 and a NUL \x00 byte",
        "    \n\n\n        indented\r\nwindows line",
        "",
    ]
    for text in samples:
        ids = loaded.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text
        assert ids == tok.encode(text, add_special_tokens=False)


def test_special_tokens_take_the_first_ids_and_vocab_size_is_respected(tmp_path):
    tok = tiny_tokenizer(vocab_size=300)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) <= 300
    save_tokenizer(tok, tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
    assert loaded.convert_ids_to_tokens([0, 1, 2]) == ["<|bos|>", "<|eos|>", "<|pad|>"]


def test_bpe_merges_frequent_code_fragments():
    tok = tiny_tokenizer(vocab_size=320)
    # "return" occurs in several corpus lines: merged into fewer tokens than its bytes
    assert len(tok.encode("return", add_special_tokens=False)) < len("return")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="no texts"):
        train_tokenizer([], vocab_size=300)


def test_load_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nothing")
