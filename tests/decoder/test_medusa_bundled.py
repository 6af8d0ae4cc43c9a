"""The shipped Medusa heads on the bundled target: exact greedy output and real acceptance."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specops.assets import MEDUSA_DIR, TARGET_DIR, assets_size_bytes
from specops.decoder import Decoder
from specops.models.medusa_heads import CONFIG_NAME, WEIGHTS_NAME, model_fingerprint


@pytest.fixture(scope="module")
def bundled():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Decoder.from_pretrained("bundled")
    torch.set_num_threads(before)


def code_prompts(dec: Decoder, count: int) -> list[list[int]]:
    from specops.train.data import code_prompts as held_out_code, split_stdlib

    texts = held_out_code(split_stdlib().heldout_files, count=count, max_chars=300, seed=7)
    return [dec.tokenizer.encode(t) for t in texts]


def test_artifact_is_small_fp16_and_names_its_base(bundled):
    config = json.loads((MEDUSA_DIR / CONFIG_NAME).read_text())
    assert config["base_model_hash"] == model_fingerprint(bundled.target_model)
    assert len(config["head_topk_accuracy"]) == config["num_heads"]
    assert (MEDUSA_DIR / WEIGHTS_NAME).stat().st_size < 9 * 2**20
    assert assets_size_bytes() < 32 * 2**20
    assert bundled.medusa is not None and TARGET_DIR.is_dir()


def test_bundled_medusa_is_exact_and_accepts(bundled):
    rng = random.Random(0)
    prompts = code_prompts(bundled, 16)
    vocab = bundled.target.vocab_size
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(34)]
    forwards = tokens = 0
    for i, prompt in enumerate(prompts):
        max_new = 32 if i < 16 else rng.randint(1, 24)
        ar = bundled.generate(prompt, method="ar", max_new_tokens=max_new)
        heads = None if i % 3 else rng.randint(1, bundled.medusa.num_heads)
        med = bundled.generate(prompt, method="medusa", max_new_tokens=max_new, heads=heads)
        assert med.tokens == ar.tokens, f"prompt {i}"
        if i < 16:
            forwards += med.stats.target_forwards
            tokens += med.stats.new_tokens
    # trained heads on code: well over one token per target forward
    assert tokens / forwards > 1.8, tokens / forwards


def test_the_lookup_branch_accepts_repetitions_the_heads_cannot_see(bundled):
    """On code the prompt-lookup branch is accepted deeper than the three heads guess, so the
    same prompts take fewer target forwards; the output stays plain decoding's."""
    forwards = {0: 0, 4: 0}
    deep = {0: 0, 4: 0}  # accepted tokens past the heads' depth: only the branch proposes those
    for prompt in code_prompts(bundled, 8):
        ar = bundled.generate(prompt, method="ar", max_new_tokens=64)
        for branch in (0, 4):
            med = bundled.generate(prompt, method="medusa", max_new_tokens=64, tree="small", lookup_branch=branch)
            assert med.tokens == ar.tokens, branch
            forwards[branch] += med.stats.target_forwards
            deep[branch] += sum(med.stats.accepted_per_pos[bundled.medusa.num_heads:])
    assert deep[0] == 0 and deep[4] > 0, deep
    assert forwards[4] < 0.95 * forwards[0], forwards


def test_the_heads_kernel_path_proposes_what_fp32_heads_propose(bundled):
    """The C-kernel heads read bf16 weights where the kernel can (half the bytes per proposal); their
    logits stay within bf16 rounding of the fp32 torch path's, and their top-3 per head are the same
    on the target's real hidden states for code prompts."""
    from specops.kernels import cpu_linear

    heads = bundled.medusa
    prompt = code_prompts(bundled, 1)[0][:64]
    hidden = bundled.target_model.model(torch.tensor([prompt])).last_hidden_state[0].detach()  # [T, E]
    rows = hidden[-5:]  # 3 heads x 5 rows <= KERNEL_MAX_ROWS: the kernel path
    lm = heads._shared_fp32
    roots = torch.nn.functional.linear(rows, lm.weight, lm.bias).argmax(-1)  # [5] the root after each row
    assert heads.config.root_input and heads.config.shortlist_size == 1024
    with torch.inference_mode():
        fast = heads(rows, roots=roots)  # [K, 5, V]: the kernel path
        # the torch path, in fp32: the heads' blocks, then the target's LM head
        slow = torch.nn.functional.linear(heads.features(rows, roots=roots).float(), lm.weight, lm.bias)
        # a proposal: each head's top-3 among the shortlisted tokens, from the shortlisted LM-head rows
        short = heads.candidates(rows, 3, 3, roots=roots)  # [K, 5, 3]
    masked = torch.full_like(slow, float("-inf"))
    masked[..., heads.shortlist] = slow[..., heads.shortlist]
    assert (short == masked.topk(3, dim=-1).indices).float().mean() >= 0.9
    assert heads._kernel_blocks[2].dtype == (torch.bfloat16 if cpu_linear.bf16_weights() else torch.float32)
    scale = slow.abs().max()
    assert (fast - slow).abs().max() < 0.02 * scale
    agree = (fast.topk(3, dim=-1).indices == slow.topk(3, dim=-1).indices).float().mean()
    assert agree >= 0.9, agree
