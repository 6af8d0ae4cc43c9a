from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specops.cli import main
from specops.train.data import TokenWindows, encode_stream
from specops.train.distill import distill_draft, kl_loss, make_draft
from specops.train.target import TrainConfig
from tests.train.tiny_assets import CORPUS, save_pair, tiny_llama, tiny_tokenizer


def test_make_draft_copies_the_first_layers_and_shares_the_vocab():
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=3)
    draft = make_draft(target, 1)
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == target.config.vocab_size
    t, d = target.state_dict(), draft.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(t[name], d[name])
    with pytest.raises(ValueError, match="fewer"):
        make_draft(target, 3)
    with pytest.raises(ValueError, match=">= 1"):
        make_draft(target, 0)


def test_distillation_lowers_the_kl():
    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=3)
    draft = make_draft(target, 1, init_from_target=False)
    stream = encode_stream(CORPUS, tok, eos_id=tok.eos_token_id)  # [N]
    batch = TokenWindows(stream, 32, seed=9).batch(8)              # [8, 33]
    with torch.no_grad():
        before = float(kl_loss(target, draft, batch))
    distill_draft(target, draft, TokenWindows(stream, 32, seed=0),
                  TrainConfig(steps=30, batch_size=8, seq_len=32, lr=1e-2, progress=False, log_every=0))
    with torch.no_grad():
        after = float(kl_loss(target, draft, batch))
    assert after < 0.7 * before
    assert not any(p.requires_grad for p in target.parameters())


def test_train_draft_cli_writes_a_loadable_draft(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, _, tok = save_pair(tmp_path, target_layers=3)
    data = tmp_path / "data.py"
    data.write_text("".join(CORPUS) * 3)
    out = tmp_path / "new_draft"
    result = CliRunner().invoke(main, ["train", "draft", "--target", str(target_dir), "--layers", "1", "--data", str(data),
                                       "--out", str(out), "--steps", "4", "--seq-len", "32", "--batch-size", "2",
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["layers"] == 1 and summary["steps"] == 4
    draft = AutoModelForCausalLM.from_pretrained(str(out))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    assert draft.dtype == torch.float32
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 1
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == tok.get_vocab()


def test_train_draft_cli_rejects_too_many_layers(tmp_path):
    target_dir, _, _ = save_pair(tmp_path, target_layers=2)
    data = tmp_path / "data.txt"
    data.write_text("".join(CORPUS))
    result = CliRunner().invoke(main, ["train", "draft", "--target", str(target_dir), "--layers", "2", "--data",
                                       str(data), "--out", str(tmp_path / "o"), "--steps", "1", "--quiet"])
    assert result.exit_code != 0
    assert "fewer than the target" in result.output
