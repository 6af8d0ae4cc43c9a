"""Medusa heads training: label alignment, frozen base, learning, accuracy tables, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specops.decoder.medusa_heads import MedusaHeads
from specops.train.heads import IGNORE, HeadsTrainConfig, evaluate_heads, heads_loss, rank_counts, train_heads
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)


class OracleHeads:
    """Stub heads whose head k at position t puts all mass on tokens[t + k + 2 + offset]."""

    def __init__(self, tokens: torch.Tensor, num_heads: int, vocab: int, offset: int = 0):
        self.tokens, self.num_heads, self.vocab, self.offset = tokens, num_heads, vocab, offset

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, E] -> [K, B, T, V]
        b, t, _ = hidden.shape
        out = torch.full((self.num_heads, b, t, self.vocab), -30.0)
        for k in range(self.num_heads):
            for pos in range(t):
                j = pos + k + 2 + self.offset
                if 0 <= j < t:
                    out[k, :, pos, self.tokens[0, j]] = 30.0
        return out


def test_loss_targets_are_k_plus_one_beyond_the_next_token():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (1, 20), generator=gen)
    hidden = torch.zeros(1, 20, 4)
    right = heads_loss(OracleHeads(tokens, 3, 16), hidden, tokens, decay=0.8)
    wrong = heads_loss(OracleHeads(tokens, 3, 16, offset=-1), hidden, tokens, decay=0.8)
    assert float(right) < 1e-6 < 10.0 < float(wrong)
    # ignored positions do not count: only wrong labels there, still zero loss
    masked = torch.where(torch.arange(20) < 10, torch.full_like(tokens, IGNORE), tokens)
    shifted = OracleHeads(torch.where(torch.arange(20) < 10, (tokens + 1) % 16, tokens), 3, 16)
    assert float(heads_loss(shifted, hidden, masked, decay=0.8)) < 1e-6
    assert float(heads_loss(shifted, hidden, tokens, decay=0.8)) > 10.0
    counts = rank_counts(OracleHeads(tokens, 3, 16), hidden, tokens, rank_k=2)
    assert counts[:, 0].tolist() == [18, 17, 16] and counts[:, 1:].sum() == 0


@pytest.mark.parametrize("self_distill", [True, False])
def test_training_keeps_base_frozen_and_improves_heads(self_distill, one_thread):
    model = tiny_model("llama", vocab=32, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    heads = MedusaHeads.from_model(model, num_heads=2)
    gen = torch.Generator().manual_seed(0)
    # data with structure the heads can learn: a noisy repeating pattern
    pattern = torch.randint(0, 32, (7,), generator=gen)
    stream = pattern.repeat(300)
    noise = torch.rand(stream.shape, generator=gen) < 0.1
    stream = torch.where(noise, torch.randint(0, 32, stream.shape, generator=gen), stream)
    heldout = stream[:320].view(8, 40)
    cfg = HeadsTrainConfig(num_heads=2, steps=40, seq_len=40, batch_size=8, distill_prompt_len=8,
                           distill_sequences=24, self_distill=self_distill, lr=1e-2, progress=False, eval_batches=1)
    untrained = evaluate_heads(model, heads, heldout, cfg)
    report = train_heads(model, heads, stream, heldout, cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"base parameter {k} changed"
    assert sum(report.losses[-5:]) < sum(report.losses[:5])
    measured = report.greedy_top1 if self_distill else report.text_top1
    baseline = untrained.greedy_top1 if self_distill else untrained.text_top1
    assert all(m > b + 0.2 for m, b in zip(measured, baseline)), (baseline, measured)
    assert heads.config.head_topk_accuracy == report.rank_accuracy
    for row, top1, top5 in zip(report.rank_accuracy, report.greedy_top1, report.greedy_top5):
        assert row[0] == top1 and sum(row[:5]) == pytest.approx(top5) and sum(row) <= 1 + 1e-9


def test_config_validation():
    with pytest.raises(ValueError, match="too short"):
        HeadsTrainConfig(num_heads=4, seq_len=6).validate()
    with pytest.raises(ValueError, match="steps must be a positive int"):
        HeadsTrainConfig(steps=0).validate()


def test_train_heads_cli(tmp_path, one_thread):
    from specops.train.cli_heads import train_heads_command
    from specops.train.tokenizer import train_tokenizer

    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))
    data = tmp_path / "data.py"
    data.write_text(text)
    tokenizer = train_tokenizer([text], vocab_size=300)
    model = tiny_model("llama", vocab=len(tokenizer), seed=2)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(train_heads_command, [
        "--model", str(tmp_path / "model"), "--heads", "2", "--data", str(data), "--out", str(tmp_path / "heads"),
        "--steps", "3", "--seq-len", "24", "--batch-size", "2", "--self-distill", "--distill-sequences", "4",
        "--threads", "1", "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "head 2 (predicts t+3)" in result.output
    report = json.loads((tmp_path / "heads" / "train_report.json").read_text())
    assert len(report["greedy_top1"]) == 2 and all(0 <= a <= 1 for a in report["text_top5"])
    heads = MedusaHeads.from_pretrained(tmp_path / "heads", base=model)
    assert len(heads.config.head_topk_accuracy) == 2
    bad = CliRunner().invoke(train_heads_command, [
        "--model", str(tmp_path / "model"), "--heads", "6", "--data", str(data), "--out", str(tmp_path / "x"),
        "--seq-len", "8",
    ])
    assert bad.exit_code != 0 and "too short" in bad.output
