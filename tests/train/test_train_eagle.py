"""``specops train eagle``: self-distilled EAGLE drafters on the bundled target.

A drafter trained for 120 steps on the target's own continuations decodes more tokens per
target forward on held-out prompts than a random one; the command runs end to end in
seconds (checkpoint, config, report, loss plot) and the result loads into `Decoder`; the
chat-model prompts the benchmark measures on never enter training; bad options get
clear errors.
"""

from __future__ import annotations

import json

import pytest

from click.testing import CliRunner

from specops.assets import TARGET_DIR
from specops.decoder import Decoder
from specops.models.eagle_model import EagleDrafter
from specops.train.cli_eagle import train_eagle_command
from specops.train.eagle import EagleTrainConfig, decode_report, prompt_texts
from tests.decoder.test_eagle import bundled_setup


def test_trained_drafter_accepts_more_than_a_random_one_on_heldout_prompts():
    model, _, _, heldout, trained = bundled_setup()
    cfg = EagleTrainConfig(eval_new_tokens=40, gamma=4)
    prompts = heldout[:4]
    random_drafter = EagleDrafter.for_target(model, shortlist=trained.shortlist, seed=1)
    good = decode_report(model, trained, prompts, cfg, eos=None)
    bad = decode_report(model, random_drafter, prompts, cfg, eos=None)
    assert good["exact_prompts"] == bad["exact_prompts"] == "4/4"
    assert good["tokens_per_target_forward"] > bad["tokens_per_target_forward"] + 0.15, (good, bad)
    assert good["acceptance_rate"] > 2 * bad["acceptance_rate"] + 0.03, (good, bad)


def test_train_eagle_command_writes_a_drafter_that_decodes(tmp_path):
    out = tmp_path / "eagle"
    result = CliRunner().invoke(train_eagle_command, [
        "--model", str(TARGET_DIR), "--out", str(out), "--minutes", "2", "--tokens", "500", "--steps", "6",
        "--shortlist", "256", "--unroll", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "held-out top-1 by chain step" in result.output
    for name in ("config.json", "model.safetensors", "eagle_report.json", "loss.png"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "eagle_report.json").read_text())
    assert report["steps"] == 6 and len(report["heldout_top1_by_step"]) == 2
    assert report["heldout_decode"]["exact_prompts"].split("/")[0] == report["heldout_decode"]["exact_prompts"].split("/")[1]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["specops_eagle"]["shortlist_size"] == 256
    dec = Decoder.from_pretrained("bundled", eagle=out)
    ref = dec.generate([5, 6, 7, 8], method="ar", max_new_tokens=12).tokens
    assert dec.generate([5, 6, 7, 8], method="eagle", max_new_tokens=12).tokens == ref


def test_a_failing_decode_report_keeps_the_trained_drafter(tmp_path, monkeypatch):
    """The drafter is written before the held-out decode report runs: a report that fails
    (here: raises) leaves the trained checkpoint, its config and its training report behind."""
    import specops.train.eagle as eagle_train

    def broken(*args, **kwargs):
        raise RuntimeError("decode report failed")

    monkeypatch.setattr(eagle_train, "decode_report", broken)
    out = tmp_path / "eagle"
    result = CliRunner().invoke(train_eagle_command, [
        "--model", str(TARGET_DIR), "--out", str(out), "--minutes", "2", "--tokens", "300", "--steps", "2",
        "--shortlist", "128", "--unroll", "1", "--quiet"])
    assert result.exit_code != 0 and isinstance(result.exception, RuntimeError)
    for name in ("config.json", "model.safetensors", "eagle_report.json", "loss.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "eagle_report.json").read_text())
    assert report["steps"] == 2 and "heldout_decode" in report and not report["heldout_decode"]
    dec = Decoder.from_pretrained("bundled", eagle=out)
    ref = dec.generate([5, 6, 7, 8], method="ar", max_new_tokens=8).tokens
    assert dec.generate([5, 6, 7, 8], method="eagle", max_new_tokens=8).tokens == ref


def test_train_eagle_command_rejects_bad_options(tmp_path):
    no_out = CliRunner().invoke(train_eagle_command, ["--model", str(TARGET_DIR)])
    assert no_out.exit_code == 2 and "--out" in no_out.output
    zero = CliRunner().invoke(train_eagle_command, ["--model", str(TARGET_DIR), "--out", str(tmp_path), "--minutes", "0"])
    assert zero.exit_code == 2 and "--minutes" in zero.output
    missing = CliRunner().invoke(train_eagle_command, ["--model", str(tmp_path / "nope"), "--out", str(tmp_path)])
    assert missing.exit_code == 2 and "neither a folder nor a registered model" in missing.output


class _ChatTokenizer:
    """A tokenizer stand-in with a chat template (what `prompt_texts` and the bench suites read)."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_benchmark_chat_prompts_are_held_out_of_training():
    from specops.bench.chat_suite import chat_model_suite

    tok = _ChatTokenizer()
    train, heldout = prompt_texts(tok)
    assert not set(train) & set(heldout)
    first = [p.text for p in chat_model_suite("mixed", tok)[:16]]
    assert set(first) <= set(heldout)
    assert len(train) > 100


def test_held_out_sequences_share_no_prompt_with_training():
    """A held-out prompt's sampled repeats are held out with it, never trained on."""
    import torch

    from specops.train.eagle import TargetSequence, split_by_prompt

    def seq(prompt):
        return TargetSequence(tokens=torch.zeros(4, dtype=torch.long), features=torch.zeros(4, 2),
                              labels=torch.zeros(4, dtype=torch.long), prompt=prompt)

    seqs = [seq(p) for p in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)] + [seq(p) for p in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)]
    held, train = split_by_prompt(seqs, 0.1)
    assert {s.prompt for s in held} == {0, 1}
    assert len(held) == 4 and len(train) == 16
    assert not {s.prompt for s in held} & {s.prompt for s in train}
    with pytest.raises(ValueError, match="held-out prompt"):
        split_by_prompt([seq(0), seq(0)], 0.5)
