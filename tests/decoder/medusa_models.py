"""Tiny random-weight models and heads for the Medusa tests (shared by test_medusa*.py / test_tree*.py)."""

from __future__ import annotations

import pytest
import torch


def tiny_model(arch: str, vocab: int = 64, seed: int = 0, layers: int = 1, context: int = 96):
    """A tiny random causal LM: "llama" | "gpt2" | "gpt_neox" | "qwen2" | "mistral"."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=context, **common))
    elif arch == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            max_position_embeddings=context, **common))
    else:
        cfg_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
        extra = {"sliding_window": None} if arch == "mistral" else {}
        model = cls(cfg_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=context, **common, **extra))
    return model.eval()


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (2 shared cores: thread contention costs 10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
