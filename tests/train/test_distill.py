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


def test_greedy_pool_rows_are_data_prompts_then_the_targets_greedy_continuation():
    from specops.train.distill import SelfDistill, greedy_pool

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=2)
    stream = encode_stream(CORPUS, tok, eos_id=tok.eos_token_id)           # [N]
    sd = SelfDistill(sequences=5, prompt_len=6, batch_size=2)
    pool = greedy_pool(target, stream, 20, sd, seed=3, progress=False)      # [5, 20]
    assert pool.shape == (5, 20)
    text = stream.tolist()
    for row in pool:
        prompt = row[:6].tolist()
        assert any(text[i:i + 6] == prompt for i in range(len(text) - 5)), "prompt not cut from the data"
        with torch.no_grad():                                               # teacher-forced argmax = the row
            argmax = target(input_ids=row[None, :-1]).logits[0].argmax(-1)  # [19]
        assert torch.equal(argmax[5:], row[6:])
    with pytest.raises(ValueError, match="prompt length"):
        SelfDistill(sequences=1, prompt_len=20).validate(20)
    with pytest.raises(ValueError, match="share"):
        SelfDistill(sequences=1, share=0.0).validate(20)


def test_mixed_batches_take_their_share_of_rows_from_the_pool():
    from specops.train.distill import MixedBatches

    tok = tiny_tokenizer()
    stream = encode_stream(CORPUS, tok, eos_id=tok.eos_token_id)
    pool = torch.full((4, 17), 7, dtype=torch.long)
    pool[:, 0] = torch.arange(4) + 1000                                    # rows tell themselves apart (ids > vocab)
    batches = MixedBatches(pool, TokenWindows(stream, 16, seed=0), 0.75, seed=0)
    batch = batches.batch(8)
    assert batch.shape == (8, 17)
    assert bool((batch[:6, 0] >= 1000).all()) and bool((batch[6:, 0] < 1000).all())
    assert set(batch[:6, 0].tolist()) > {batch[0, 0].item()}               # rows are drawn, not repeated
    with pytest.raises(ValueError, match="tokens"):
        MixedBatches(pool[:, :10], TokenWindows(stream, 16), 0.5)


def test_self_distillation_fits_the_targets_own_continuations():
    """Continuing a draft on the target's greedy output lowers its KL on that output
    more than the same steps on text alone."""
    from specops.train.distill import MixedBatches, SelfDistill, greedy_pool

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=3)
    stream = encode_stream(CORPUS, tok, eos_id=tok.eos_token_id)
    sd = SelfDistill(sequences=24, prompt_len=4, batch_size=8)
    pool = greedy_pool(target, stream, 33, sd, seed=0, progress=False)     # [24, 33]
    held = greedy_pool(target, stream, 33, sd, seed=9, progress=False)     # other prompts
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=1e-2, progress=False, log_every=0)
    kls = {}
    for name in ("text", "self"):
        draft = make_draft(target, 1, init_from_target=False)
        windows = TokenWindows(stream, 32, seed=0)
        distill_draft(target, draft, windows if name == "text" else MixedBatches(pool, windows, 0.75), cfg)
        with torch.no_grad():
            kls[name] = float(kl_loss(target, draft, held))
    assert kls["self"] < kls["text"]


def test_train_draft_cli_continues_a_draft_with_self_distillation(tmp_path):
    target_dir, draft_dir, _ = save_pair(tmp_path, target_layers=3)
    data = tmp_path / "data.py"
    data.write_text("".join(CORPUS) * 3)
    out = tmp_path / "continued"
    result = CliRunner().invoke(main, ["train", "draft", "--target", str(target_dir), "--init-draft", str(draft_dir),
                                       "--data", str(data), "--out", str(out), "--steps", "3", "--seq-len", "32",
                                       "--batch-size", "4", "--self-distill", "6", "--eval-prompts", "1",
                                       "--eval-new-tokens", "8", "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["init_draft"] == str(draft_dir) and summary["steps"] == 3
    assert summary["self_distill"]["sequences"] == 6
    for key in ("greedy_acceptance_before", "greedy_acceptance"):
        assert summary[key]["prompts"] == 1 and 0 < summary[key]["new_tokens"] <= 8
    assert "--init-draft" in summary["command"] and "--self-distill 6" in summary["command"]
    assert json.loads((out / "train_report.json").read_text()) == summary


@pytest.mark.parametrize("args, message", [
    (["--data", "DATA", "--layers", "1", "--init-draft", "DRAFT"], "--layers cannot be combined"),
    ([], "give --data files or --stdlib"),
    (["--data", "DATA", "--stdlib"], "give --data files or --stdlib"),
    (["--data", "DATA", "--self-distill", "-1"], "self-distill sequences"),
    (["--data", "DATA", "--eval-prompts", "0"], "--eval-prompts"),
])
def test_train_draft_cli_rejects_bad_combinations(tmp_path, args, message):
    target_dir, draft_dir, _ = save_pair(tmp_path, target_layers=2)
    data = tmp_path / "data.txt"
    data.write_text("".join(CORPUS))
    args = [str(draft_dir) if a == "DRAFT" else str(data) if a == "DATA" else a for a in args]
    result = CliRunner().invoke(main, ["train", "draft", "--target", str(target_dir), "--out", str(tmp_path / "o"),
                                       "--steps", "1", "--quiet", *args])
    assert result.exit_code != 0
    assert message in result.output
