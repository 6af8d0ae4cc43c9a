"""Medusa heads training: label alignment, frozen base, learning, accuracy tables, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specops.models.medusa_heads import MedusaHeads
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
                if 0 <= j < self.tokens.shape[1]:
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
    # continuing those heads with the root input: same blocks, R from zero, the flag saved
    cont = CliRunner().invoke(train_heads_command, [
        "--model", str(tmp_path / "model"), "--heads", "2", "--data", str(data), "--out", str(tmp_path / "root"),
        "--steps", "3", "--seq-len", "24", "--batch-size", "2", "--self-distill", "--distill-sequences", "4",
        "--threads", "1", "--quiet", "--root-input", "--init-heads", str(tmp_path / "heads"), "--shortlist", "50",
    ])
    assert cont.exit_code == 0, cont.output
    rooted = MedusaHeads.from_pretrained(tmp_path / "root", base=model, dtype=torch.float32)
    assert rooted.config.shortlist_size == 50 and rooted.shortlist.unique().numel() == 50
    assert rooted.config.root_input and float(rooted.root_proj.weight.detach().abs().sum()) > 0  # R trained
    mismatch = CliRunner().invoke(train_heads_command, [
        "--model", str(tmp_path / "model"), "--heads", "1", "--data", str(data), "--out", str(tmp_path / "y"),
        "--steps", "1", "--seq-len", "24", "--self-distill", "--distill-sequences", "2", "--quiet",
        "--init-heads", str(tmp_path / "heads"),
    ])
    assert mismatch.exit_code != 0 and "more than this run" in mismatch.output
    too_long = CliRunner().invoke(train_heads_command, [
        "--model", str(tmp_path / "model"), "--heads", "2", "--data", str(data), "--out", str(tmp_path / "z"),
        "--steps", "1", "--seq-len", "24", "--quiet", "--shortlist", "100000",
    ])
    assert too_long.exit_code != 0 and "exceeds the vocabulary" in too_long.output


class RootRecorder:
    """Stub root_input heads: records the roots they get and returns zero logits."""

    config = type("Config", (), {"root_input": True})()

    def __init__(self, num_heads: int, vocab: int):
        self.num_heads, self.vocab, self.calls = num_heads, vocab, []

    def __call__(self, hidden: torch.Tensor, roots: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((hidden.shape, roots))
        return torch.zeros(self.num_heads, *hidden.shape[:-1], self.vocab, requires_grad=True)


def test_root_input_heads_train_with_the_next_token_as_their_root():
    """Head k at t predicts x_{t+k+2} from h_t and the root x_{t+1}: the loss feeds the sequence
    shifted by one (never the IGNORE labels of the prompt), and drops the last position."""
    tokens = torch.arange(3, 23)[None]  # [1, 20]
    labels = tokens.clone()
    labels[:, :5] = IGNORE
    heads = RootRecorder(3, 32)
    heads_loss(heads, torch.zeros(1, 20, 4), labels, decay=0.8, tokens=tokens)
    (shape, roots), = heads.calls
    assert tuple(shape) == (1, 19, 4) and torch.equal(roots, tokens[:, 1:])
    rank_counts(heads, torch.zeros(1, 20, 4), tokens, rank_k=2)
    assert torch.equal(heads.calls[-1][1], tokens[:, 1:])


def test_frequency_shortlist_orders_tokens_by_count():
    from specops.train.heads import frequency_shortlist

    stream = torch.tensor([5, 5, 5, 2, 2, 9, 0, 9, 9, 9])
    assert frequency_shortlist(stream, 3, 10).tolist() == [9, 5, 2]
    assert frequency_shortlist(stream, 5, 10).tolist() == [9, 5, 2, 0, 1]  # ties: lower id first
    with pytest.raises(ValueError, match="shortlist"):
        frequency_shortlist(stream, 11, 10)


def test_train_heads_cli_takes_data_or_stdlib(tmp_path):
    from specops.train.cli_heads import train_heads_command

    data = tmp_path / "d.py"
    data.write_text("x = 1\n")
    for args, message in (([], "--data files or --stdlib"), (["--data", str(data), "--stdlib"], "one of them"),
                          (["--stdlib", "--heldout", str(data)], "drop --heldout")):
        result = CliRunner().invoke(train_heads_command, ["--model", str(tmp_path), "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_continuing_heads_that_carry_a_shortlist():
    """The shipped heads carry a shortlist; continuing them loads their weights and leaves the
    shortlist to this run's --shortlist (it is not a weight)."""
    from specops.train.heads import continue_heads

    model = tiny_model("llama")
    init = MedusaHeads.from_model(model, num_heads=2, shared_lm_head=True, root_input=True)
    with torch.no_grad():
        init.root_proj.weight.fill_(0.25)
    init.set_shortlist(torch.arange(10))
    fresh = MedusaHeads.from_model(model, num_heads=2, shared_lm_head=True, root_input=True)
    continue_heads(fresh, init)
    assert torch.equal(fresh.root_proj.weight, init.root_proj.weight) and fresh.shortlist is None


@pytest.mark.parametrize("shared", [True, False])
def test_continuing_fewer_heads_copies_the_last_into_the_new_ones(shared):
    """``--init-heads`` with fewer heads: the first heads are the init's, each extra one starts
    as the init's last (so it proposes what that head proposes); more heads than this run is an error."""
    from specops.train.heads import continue_heads

    model = tiny_model("llama")
    init = MedusaHeads.from_model(model, num_heads=2, num_layers=2, shared_lm_head=shared, root_input=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in init.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    fresh = MedusaHeads.from_model(model, num_heads=4, num_layers=2, shared_lm_head=shared, root_input=True)
    continue_heads(fresh, init)
    hidden, roots = torch.randn(3, fresh.config.hidden_size), torch.tensor([1, 2, 3])
    with torch.no_grad():
        theirs, mine = init(hidden, roots=roots), fresh(hidden, roots=roots)  # [K, 3, V]
    assert torch.equal(mine[:2], theirs) and torch.equal(mine[2], theirs[1]) and torch.equal(mine[3], theirs[1])
    with pytest.raises(ValueError, match="more than this run"):
        continue_heads(MedusaHeads.from_model(model, num_heads=1, num_layers=2, shared_lm_head=shared), init)
