"""The committed bundled models: loadable with plain transformers, within the size budget."""

from __future__ import annotations

import json

import pytest
import torch

from specops.assets import ASSETS_DIR, DRAFT_DIR, REPORT_PATH, SIZE_BUDGET_BYTES, TARGET_DIR, assets_size_bytes


def test_assets_fit_the_size_budget():
    assert (TARGET_DIR / "model.safetensors").is_file(), "bundled target missing: run `specops train tiny`"
    assert assets_size_bytes() <= SIZE_BUDGET_BYTES
    # target + draft + tokenizer leave room for the Medusa heads (~8 MB)
    mine = assets_size_bytes(TARGET_DIR) + assets_size_bytes(DRAFT_DIR) + (ASSETS_DIR / "tokenizer.json").stat().st_size
    assert mine <= 22 * 1024 * 1024


def test_assets_load_with_transformers_and_agree():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS_DIR))
    target = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR))
    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR))
    assert target.dtype == torch.float32 and draft.dtype == torch.float32
    assert target.config.model_type == "llama"
    assert len(tok) == target.config.vocab_size == draft.config.vocab_size
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert AutoTokenizer.from_pretrained(str(TARGET_DIR)).get_vocab() == tok.get_vocab()
    text = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits  # [1, T, V]
    assert torch.isfinite(logits).all()


def test_training_report_describes_the_assets():
    report = json.loads(REPORT_PATH.read_text())
    assert report["target"]["heldout_loss_nats"] > 0
    assert 0 < report["draft"]["greedy_acceptance"]["acceptance_rate"] <= 1


@pytest.mark.parametrize("folder", [TARGET_DIR, DRAFT_DIR])
def test_weights_are_stored_in_fp16(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F16"}
