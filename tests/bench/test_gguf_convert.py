from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specops.assets import TARGET_DIR
from specops.bench.gguf_convert import (FINGERPRINT_KEY, GGUFConvertError, ensure_gguf, gguf_cache_path,
                                        interleave_rope_rows, read_bpe_tokenizer, read_llama_config)
from tests.bench.peer_support import require_module


def _rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RoPE: dimension i pairs with i + hd/2. x: [H, hd]; cos, sin: [hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_adjacent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Llama RoPE ("normal" mode): dimension 2i pairs with 2i + 1. x: [H, hd]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_interleaved_rows_make_adjacent_rope_equal_rotate_half_attention(heads, kv_heads):
    torch.manual_seed(0)
    hd, dim, pos = 16, 32, 37
    wq, wk = torch.randn(heads * hd, dim), torch.randn(kv_heads * hd, dim)  # [H*hd, D], [H_kv*hd, D]
    x = torch.randn(dim)  # [D]
    freqs = pos / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    cos, sin = freqs.cos().float(), freqs.sin().float()
    q_hf = _rope_rotate_half((wq @ x).view(heads, hd), cos, sin)  # [H, hd]
    k_hf = _rope_rotate_half((wk @ x).view(kv_heads, hd), cos, sin)
    q_gg = _rope_adjacent((interleave_rope_rows(wq, heads) @ x).view(heads, hd), cos, sin)
    k_gg = _rope_adjacent((interleave_rope_rows(wk, kv_heads) @ x).view(kv_heads, hd), cos, sin)
    group = heads // kv_heads
    scores_hf = (q_hf * k_hf.repeat_interleave(group, 0)).sum(-1)  # [H]
    scores_gg = (q_gg * k_gg.repeat_interleave(group, 0)).sum(-1)
    torch.testing.assert_close(scores_gg, scores_hf, rtol=1e-5, atol=1e-4)
    # and without the permutation the two RoPEs disagree (the test can fail)
    q_raw = _rope_adjacent((wq @ x).view(heads, hd), cos, sin)
    assert not torch.allclose(q_raw, q_gg, atol=1e-3)


def _model_dir(tmp_path, **config):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_unsupported_architecture_is_a_clear_error_and_writes_nothing(tmp_path):
    d = _model_dir(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=10)
    with pytest.raises(GGUFConvertError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        ensure_gguf(d, cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in d.iterdir()) == ["config.json"] and not (tmp_path / "cache").exists()


def test_llama_variants_it_cannot_express_are_refused(tmp_path):
    base = json.loads((TARGET_DIR / "config.json").read_text())
    cases = {"rope_type 'llama3'": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
             "attention_bias": {"attention_bias": True},
             "hidden_act 'gelu'": {"hidden_act": "gelu"}}
    for i, (message, change) in enumerate(cases.items()):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(GGUFConvertError, match=message):
            read_llama_config(d)


def test_bundled_tokenizer_maps_to_gguf_vocab():
    require_module("gguf")
    shape = read_llama_config(TARGET_DIR)
    vocab = read_bpe_tokenizer(TARGET_DIR / "tokenizer.json", shape.vocab_size)
    spec = json.loads((TARGET_DIR / "tokenizer.json").read_text())
    assert len(vocab.tokens) == shape.vocab_size == 4096
    for tok, i in list(spec["model"]["vocab"].items())[::97]:
        assert vocab.tokens[i] == tok
    assert vocab.token_types[:3] == [3, 3, 3] and set(vocab.token_types[3:]) == {1}  # CONTROL, then NORMAL
    assert vocab.merges[0] == " ".join(spec["model"]["merges"][0]) and len(vocab.merges) == len(spec["model"]["merges"])
    assert vocab.add_bos is False  # the bundled tokenizer adds no BOS


def test_conversion_is_cached_and_rebuilt_when_the_sources_change(tmp_path):
    gguf = require_module("gguf")
    d = tmp_path / "target"
    shutil.copytree(TARGET_DIR, d)
    path = ensure_gguf(d)
    assert path == d / "model-float32.gguf" == gguf_cache_path(d, "float32")
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert len(names) == 2 + 9 * 8 and "output.weight" not in names  # tied LM head: llama.cpp reuses token_embd
    fingerprint = reader.get_field(FINGERPRINT_KEY).contents()
    stamp = path.stat().st_mtime_ns
    assert ensure_gguf(d) == path and path.stat().st_mtime_ns == stamp  # reused
    weights = d / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert ensure_gguf(d) == path
    assert gguf.GGUFReader(str(path)).get_field(FINGERPRINT_KEY).contents() != fingerprint  # rebuilt
    assert not [p for p in d.iterdir() if p.suffix == ".tmp"]


def test_bundled_models_are_never_written_into(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path))
    path = gguf_cache_path(TARGET_DIR, "float32")
    assert path.is_relative_to(tmp_path) and not path.is_relative_to(TARGET_DIR)


def test_explicit_cache_dir_keeps_the_model_folder_untouched(tmp_path):
    require_module("gguf")
    d = tmp_path / "target"
    shutil.copytree(TARGET_DIR, d)
    before = sorted(p.name for p in d.iterdir())
    path = ensure_gguf(d, out_type="float16", cache_dir=tmp_path / "cache")
    assert path.is_relative_to(tmp_path / "cache") and path.name == "model-float16.gguf"
    assert sorted(p.name for p in d.iterdir()) == before


def test_a_model_pulled_from_a_gguf_keeps_that_files_tokenizer_keys(tmp_path):
    """A folder that `specops models pull` made from a GGUF (``source_gguf`` in its manifest):
    the converted file carries the source's ``tokenizer.*`` keys as they are (its own
    pre-tokenizer, special tokens and chat template), not a vocabulary rebuilt from
    tokenizer.json."""
    gguf = require_module("gguf")
    d = tmp_path / "model"
    shutil.copytree(TARGET_DIR, d, ignore=shutil.ignore_patterns("*.gguf"))
    source = d / "gguf" / "source.gguf"
    source.parent.mkdir()
    w = gguf.GGUFWriter(str(source), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"t{i}" for i in range(8)])
    w.add_token_types([1] * 8)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (d / "specops-model.json").write_text(json.dumps({"source_gguf": "gguf/source.gguf"}))
    path = ensure_gguf(d, cache_dir=tmp_path / "cache")
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.ggml.tokens"].contents() == [f"t{i}" for i in range(8)]
    assert fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert "tokenizer.ggml.merges" not in fields  # nothing rebuilt from tokenizer.json
    # the pulled model's bfloat16 copy (its bf16/ folder, no manifest of its own) keeps the same keys
    shutil.copytree(TARGET_DIR, d / "bf16", ignore=shutil.ignore_patterns("*.gguf"))
    path = ensure_gguf(d / "bf16", out_type="bfloat16", cache_dir=tmp_path / "cache")
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm" and "tokenizer.ggml.merges" not in fields
