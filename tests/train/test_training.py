from __future__ import annotations

import pytest
import torch

from specops.train.data import DataError, TokenWindows, code_prompts, encode_stream, split_stdlib
from specops.train.evaluate import greedy_acceptance, replay_blocks
from specops.train.target import TrainConfig, cosine_lr, heldout_loss, train_target
from tests.train.tiny_assets import CORPUS, tiny_llama, tiny_tokenizer


def test_training_lowers_the_loss():
    tok = tiny_tokenizer()
    stream = encode_stream(CORPUS, tok, eos_id=tok.eos_token_id)  # [N]
    model = tiny_llama(len(tok), layers=2, hidden=32)
    with torch.no_grad():  # back to a normal init scale for training
        for p in model.parameters():
            if p.dim() >= 2:
                p.div_(4.0)
    windows = TokenWindows(stream, 32, seed=0)
    before = heldout_loss(model, TokenWindows(stream, 32), batch_size=4, max_batches=2)
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=1e-2, progress=False, log_every=0)
    result = train_target(model, windows, cfg)
    after = heldout_loss(model, TokenWindows(stream, 32), batch_size=4, max_batches=2)
    assert result.steps == 40 and len(result.losses) == 40
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 1.0
    assert after < before - 1.0


def test_cosine_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_fraction=0.1)
    assert cosine_lr(0.05, cfg) == pytest.approx(0.5)
    assert cosine_lr(0.1, cfg) == pytest.approx(1.0)
    assert cosine_lr(1.0, cfg) == pytest.approx(0.1)
    values = [cosine_lr(x / 100, cfg) for x in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0).validate()
    with pytest.raises(ValueError, match="minutes"):
        TrainConfig(minutes=-1).validate()


def test_token_windows_shapes_and_errors():
    stream = torch.arange(100)
    windows = TokenWindows(stream, 10, seed=3)
    batch = windows.batch(4)  # [4, 11]
    assert batch.shape == (4, 11)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 10, dtype=torch.long))  # contiguous windows
    seq = list(windows.sequential(batch_size=3, max_batches=10))
    assert sum(b.shape[0] for b in seq) == 9 and seq[0][0, 0] == 0 and seq[0][1, 0] == 10
    with pytest.raises(DataError):
        TokenWindows(torch.arange(5), 10)
    with pytest.raises(DataError):
        TokenWindows(torch.zeros(2, 50, dtype=torch.long), 10)


def test_stdlib_split_keeps_tests_out_of_training():
    split = split_stdlib()
    assert split.train_files and split.heldout_files
    assert not any("test" in p.relative_to(split.root).parts[:-1] for p in split.train_files)
    assert all(p.parent.name == "test" for p in split.heldout_files)
    prompts = code_prompts(split.heldout_files, count=3, seed=0)
    assert prompts == code_prompts(split.heldout_files, count=3, seed=0)  # deterministic
    assert all(p.endswith("\n") for p in prompts)


@pytest.mark.parametrize(
    "agree, gamma, expected",
    [
        # all agree, 8 new tokens, gamma 3: blocks of 3 accepted + 1 target token, then 1 left (drafts 0)
        ([True] * 8, 3, (6, 6, 2, [2, 2, 2])),
        # nothing agrees: every forward drafts min(gamma, left-1) and accepts none
        ([False] * 4, 2, (2 + 2 + 1, 0, 4, [0, 0])),
        # first block accepts 1 then rejects; second block starts after the correction
        ([True, False, True, True, True], 4, (4 + 2, 1 + 2, 2, [2, 1, 0, 0])),
    ],
)
def test_replay_blocks(agree, gamma, expected):
    assert replay_blocks(agree, gamma) == expected


def test_greedy_acceptance_of_a_model_against_itself_is_total():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), layers=1)
    other = tiny_llama(len(tok), layers=1)
    with torch.no_grad():
        other.model.norm.weight.neg_()  # negated logits: its argmax is the target's argmin
    prompts = [tok.encode(t, add_special_tokens=False) for t in CORPUS[:3]]
    same = greedy_acceptance(model, model, prompts, max_new_tokens=12, gamma=3)
    assert same.acceptance_rate == 1.0 and same.top1_agreement == 1.0
    assert same.new_tokens == 36
    diff = greedy_acceptance(model, other, prompts, max_new_tokens=12, gamma=3)
    assert diff.acceptance_rate < 1.0
