"""Tiny random-weight causal LMs for the decoder tests (built in milliseconds, seeded).

``init_range`` is larger than transformers' default so the logits are peaked: greedy
argmax then has clear winners (no float-rounding ties between runners) and a slightly
perturbed copy of a model makes a draft that accepts often but not always.
"""

from __future__ import annotations

import torch

# One intra-op thread: on a small shared CPU, torch's default thread pool makes these
# tiny forwards ~10x slower through contention.
torch.set_num_threads(1)

VOCAB = 96
ARGMAX_TOL = 1e-4  # an emitted token's logit may trail the maximum by float rounding only


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, init_range: float = 0.25,
               max_positions: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, init_range: float = 0.25,
              max_positions: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        n_positions=max_positions,
        initializer_range=init_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return GPT2LMHeadModel(cfg).eval()


def perturbed(model, noise: float, seed: int = 1):
    """A copy of ``model`` with Gaussian noise (relative to each tensor's std) on every weight."""
    import copy

    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            scale = float(p.std()) if p.numel() > 1 else 1.0
            p.add_(noise * scale * torch.randn(p.shape, generator=gen))
    return clone.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """transformers' own ``generate(do_sample=False)``: the reference for greedy exactness."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def tiny_other(arch: str, seed: int = 0, vocab: int = VOCAB, init_range: float = 0.25, max_positions: int = 256):
    """A tiny Qwen2, Mistral or GPT-NeoX model (more architectures behind the same API)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=max_positions, initializer_range=init_range,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    if arch == "mistral":
        cfg = transformers.MistralConfig(intermediate_size=64, num_key_value_heads=2, sliding_window=None, **common)
        return transformers.MistralForCausalLM(cfg).eval()
    if arch == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(intermediate_size=64, **common)
        return transformers.GPTNeoXForCausalLM(cfg).eval()
    raise ValueError(f"unknown architecture {arch!r}")


def transformers_greedy_violations(model, cases: list[tuple[list[int], list[int], int | None, int]]) -> list:
    """Cases ``(prompt, output, eos, max_new_tokens)`` whose output is not transformers' greedy decoding.

    One right-padded forward over every ``prompt + output`` (causal attention: padding
    after a sequence never changes its logits): each output token must be the argmax of
    the logits before it, and the output must stop at its first EOS or at the budget.
    """
    bad = []
    seqs = [prompt + out for prompt, out, _, _ in cases]
    width = max(map(len, seqs))
    ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in seqs])  # [B, L]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # [B, L, V]
    for b, (prompt, out, eos, n) in enumerate(cases):
        rows = logits[b, len(prompt) - 1 : len(prompt) - 1 + len(out)]  # [len(out), V]
        chosen = rows.gather(1, torch.tensor(out)[:, None])[:, 0]  # [len(out)]
        not_argmax = bool((chosen < rows.max(dim=1).values - ARGMAX_TOL).any())
        stops_right = (out.index(eos) == len(out) - 1) if eos in out else len(out) == n
        if not out or not_argmax or not stops_right:
            bad.append((prompt, out, eos, n))
    return bad
