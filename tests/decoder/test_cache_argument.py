"""The cache keyword transformers' forwards take changed name within 5.x (`past_key_values`,
then `cache`); an unknown keyword vanishes into the forward's ``**kwargs``, so a cache passed
under the wrong name is silently unused. A GPU image's transformers 5.17 did exactly that to
`HFRunner` (its CUDA test read logits 5.0 off) and to the Medusa heads' distillation data."""

from __future__ import annotations

import pytest
import torch

from specops.models.hf_runner import HFRunner, cache_argument
from specops.models.runner import UnsupportedModelError
from specops.train.heads import greedy_continuations
from tests.train.tiny_assets import tiny_llama


class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False, **kwargs):
        return None


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False, **kwargs):
        return None


class _Neither(torch.nn.Module):
    def forward(self, input_ids, **kwargs):
        return None


def test_the_cache_keyword_follows_the_forward_signature():
    assert cache_argument(_Old()) == "past_key_values"
    assert cache_argument(_New()) == "cache"
    with pytest.raises(UnsupportedModelError, match="neither `cache` nor `past_key_values`"):
        cache_argument(_Neither())
    model = tiny_llama(64)
    assert cache_argument(model) in ("cache", "past_key_values")


@torch.no_grad()
def test_cached_steps_equal_full_recomputes():
    """With the cache in use, one-token steps give the logits of a full forward over the whole
    sequence; with it dropped they would be the logits of the last token alone."""
    model = tiny_llama(64, seed=3)
    prompts = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(4))  # [B, P]
    seq = greedy_continuations(model, prompts, 6)  # [B, P + 6]
    want = prompts
    for _ in range(6):
        nxt = model(input_ids=want, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        want = torch.cat([want, nxt], 1)
    assert torch.equal(seq, want)

    runner = HFRunner(model)
    runner.forward(prompts[:1])
    step = runner.forward(want[:1, 9:10]).logits[0, -1]  # [V]
    full = model(input_ids=want[:1, :10], use_cache=False).logits[0, -1].float()
    alone = model(input_ids=want[:1, 9:10], use_cache=False).logits[0, -1].float()
    assert torch.allclose(step, full, atol=1e-4) and not torch.allclose(step, alone, atol=1e-2)
