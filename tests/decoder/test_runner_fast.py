"""FastLlamaRunner equals transformers' forward (fp32, atol 1e-4) for Llama, Mistral and
Qwen2 configs: GQA/MQA, q/k/v biases, a head_dim that differs from hidden/heads, rope_theta
and linear RoPE scaling, tied embeddings — through prefill, steps, truncate, a random tree
forward and compaction (the shared scenario in test_runner.py)."""

from __future__ import annotations

import pytest
import torch

from specops.models.fast_llama import FastLlamaRunner
from specops.models.runner import UnsupportedModelError
from tests.decoder.test_runner import (  # noqa: F401  (one_thread: autouse fixture)
    VOCAB,
    build,
    close,
    one_thread,
    random_tree,
    reference,
    reference_hidden,
    run_scenario,
)

CONFIGS = {
    "llama-gqa-theta": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "llama-bias-headdim-linear-rope-tied": (
        "llama",
        dict(
            hidden_size=48, head_dim=16, num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
            mlp_bias=True, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        ),
    ),
    "llama-llama3-rope": (
        "llama",
        dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    ),
    "qwen2-yarn-rope": (
        "qwen2",
        dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "rope_theta": 10000.0}),
    ),
    "mistral-mqa": ("mistral", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2-gqa-bias": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_runner_matches_transformers(name):
    model_type, overrides = CONFIGS[name]
    model = build(model_type, seed=11, **overrides)
    runner = FastLlamaRunner(model)
    run_scenario(runner, model, seed=13, tree_nodes=8)
    runner.reset()
    run_scenario(runner, model, seed=17, tree_nodes=5)  # a reused runner starts clean
    runner.reset()
    run_scenario(runner, model, seed=19, tree_nodes=8, keep_as_list=True)  # `compact_ascending`'s moves


def test_tied_embeddings_are_exercised():
    model, = (build("llama", **CONFIGS["llama-bias-headdim-linear-rope-tied"][1]),)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_fast_runner_greedy_equals_transformers_generate():
    model = build("qwen2", seed=21)
    runner = FastLlamaRunner(model)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    logits = runner.forward(prompt).logits
    tokens = []
    for _ in range(20):
        tok = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        tokens.append(int(tok))
        logits = runner.forward(tok).logits
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                              pad_token_id=0)
    assert tokens == want[0, 5:].tolist()


def test_fast_runner_batch_of_two_with_a_tree():
    model = build("llama", seed=23)
    runner = FastLlamaRunner(model)
    runner.reset(batch_size=2)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
    out = runner.forward(ids)
    with torch.no_grad():
        close(out.logits, model(ids).logits, "batch prefill")
    parents, tree_mask, depth = random_tree(4, gen)
    nodes = torch.randint(0, VOCAB, (2, 4), generator=gen)
    positions = torch.tensor([[6 + d for d in depth]] * 2)
    out = runner.forward(nodes, position_ids=positions, tree_mask=tree_mask)
    for b in range(2):
        for i in range(4):
            path = [j for j in range(4) if tree_mask[i, j]]
            want = reference(model, ids[b].tolist() + nodes[b, path].tolist())[-1]
            close(out.logits[b, i], want, f"batch row {b} tree node {i}")


def test_kernel_tree_attention_call_site_matches_sdpa():
    model = build("qwen2", seed=29, num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, VOCAB, (1, 9), generator=gen)
    _, tree_mask, depth = random_tree(6, gen)
    nodes = torch.randint(0, VOCAB, (1, 6), generator=gen)
    positions = torch.tensor([[9 + d for d in depth]])
    outs = {}
    for impl in ("sdpa", "kernel"):
        runner = FastLlamaRunner(model, tree_attention=impl)
        runner.forward(prefix)
        outs[impl] = runner.forward(nodes, position_ids=positions, tree_mask=tree_mask).logits
    close(outs["kernel"], outs["sdpa"], "kernels.tree_attention vs SDPA")
    with pytest.raises(ValueError, match="tree_attention must be one of"):
        FastLlamaRunner(model, tree_attention="flash")


def test_default_context_is_capped_for_long_context_models():
    from specops.models.fast_llama import DEFAULT_MAX_CONTEXT

    model = build("llama", max_position_embeddings=4 * DEFAULT_MAX_CONTEXT)
    assert FastLlamaRunner(model).max_context == DEFAULT_MAX_CONTEXT
    assert FastLlamaRunner(model, max_context=DEFAULT_MAX_CONTEXT + 8).max_context == DEFAULT_MAX_CONTEXT + 8


def test_fast_runner_rejects_what_it_cannot_run_exactly():
    with pytest.raises(UnsupportedModelError, match="runs llama, mistral, qwen2"):
        FastLlamaRunner(build("gpt2"))
    with pytest.raises(UnsupportedModelError, match="depends on the sequence length"):
        FastLlamaRunner(build("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        FastLlamaRunner(build("mistral", sliding_window=8), max_context=32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_run_and_return_float32_logits(dtype):
    """Half precision rounds differently from transformers' op order, so only closeness at
    the dtype's resolution (and the runner's float32 output) is checked."""
    model = build("qwen2", seed=31).to(dtype)
    runner = FastLlamaRunner(model)
    assert runner.dtype == dtype
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    first = runner.forward(ids[:, :7]).logits
    second = runner.forward(ids[:, 7:], need_hidden=True)
    got = torch.cat([first, second.logits], dim=1)[0]  # [10, V]
    assert got.dtype == torch.float32 and second.hidden.dtype == dtype
    want = reference(model, ids[0].tolist())
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale


def test_fast_runner_without_onednn_matches_transformers():
    """The MKL-only matmul path (used where oneDNN's prepacked linear is unavailable)."""
    model_type, overrides = CONFIGS["qwen2-gqa-bias"]
    model = build(model_type, seed=37, **overrides)
    runner = FastLlamaRunner(model, onednn=False)
    assert runner.onednn is False
    run_scenario(runner, model, seed=41, tree_nodes=6)


def test_fast_runner_without_precomputed_head_tables_matches_transformers(monkeypatch):
    """Models whose per-head rotary tables would be too big assemble them per forward."""
    import specops.models.fast_llama as fast_llama

    monkeypatch.setattr(fast_llama, "ROPE_HEAD_TABLE_BYTES", 0)
    model_type, overrides = CONFIGS["llama-gqa-theta"]
    model = build(model_type, seed=43, **overrides)
    runner = FastLlamaRunner(model)
    assert runner._cos_heads is None
    run_scenario(runner, model, seed=47, tree_nodes=6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["fast", "hf"])
def test_runners_on_cuda_match_transformers(impl):
    """On a GPU the fast path's tree forwards go through the Triton tree-attention kernel."""
    from specops.models.loading import load_runner

    model_type, overrides = CONFIGS["qwen2-gqa-bias"]
    model = build(model_type, seed=59, **overrides).cuda()
    runner = load_runner(model, impl=impl)
    assert runner.device.type == "cuda"
    run_scenario(runner, model, seed=61, tree_nodes=8)


def test_a_prompt_pass_on_the_c_stack_reads_only_its_last_logits():
    """`prompt_forward`: the whole prompt through the C layer stack with the LM head on the last
    row (or none); the same logits and hidden states as transformers' forward, the cache as a
    plain forward leaves it (the decoding steps after it agree), and runners without their own
    prompt pass return `forward`'s output."""
    from specops.models.hf_runner import HFRunner
    from specops.models.runner import prompt_forward

    model = build("llama", seed=5)
    runner = FastLlamaRunner(model)
    assert runner.c_layers, "the C layer stack must run here (fp32 CPU, kernels built) for this test to mean anything"
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    want = reference(model, tokens)  # [40, V]
    want_hidden = reference_hidden(model, tokens)  # [40, E]

    runner.reset()
    out = prompt_forward(runner, torch.tensor([tokens[:30]]), need_hidden=True)
    assert out.logits.shape == (1, 1, VOCAB)
    close(out.logits[0, -1], want[29], "last prompt logits")
    close(out.hidden[0], want_hidden[:30], "prompt hidden states")
    assert runner.cache_len == 30
    steps = [runner.forward(torch.tensor([[t]])).logits[0, -1] for t in tokens[30:]]
    close(torch.stack(steps), want[30:], "steps after the prompt pass")

    runner.reset()
    out = prompt_forward(runner, torch.tensor([tokens[:30]]), logits=False)
    assert out.logits.shape == (1, 0, VOCAB) and out.hidden is None and runner.cache_len == 30
    chain = runner.forward(torch.tensor([tokens[30:]])).logits[0]  # a block after it, as verification runs
    close(chain, want[30:], "a block after a logit-free prompt pass")

    hf = HFRunner(model)
    hf.reset()
    out = prompt_forward(hf, torch.tensor([tokens[:30]]))
    assert out.logits.shape == (1, 30, VOCAB)
    close(out.logits[0, -1], want[29], "a runner without its own prompt pass")
    with pytest.raises(ValueError, match="max_context"):
        prompt_forward(runner, torch.zeros(1, runner.max_context + 1, dtype=torch.long))


def test_the_c_stack_returns_each_logit_rows_argmax_with_its_logits():
    """`RunnerOutput.argmax`: the C layer stack's argmax of each logit row it returns (a prompt
    pass's last row, a step, a block, a tree), equal to torch.argmax of those logits, so greedy
    decoders read their choice without another call; `choices` / `last_choice` give the same
    for runners that do not compute it (transformers here), and a logit-free pass has none."""
    from specops.models.hf_runner import HFRunner
    from specops.models.runner import RunnerOutput, prompt_forward

    model = build("llama", seed=7)
    runner = FastLlamaRunner(model)
    assert runner.c_layers, "the C layer stack must run here (fp32 CPU, kernels built) for this test to mean anything"
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    runner.reset()
    out = prompt_forward(runner, torch.tensor([tokens[:20]]))
    assert out.argmax == [int(torch.argmax(out.logits[0, -1]))] and out.last_choice() == out.argmax[0]
    assert prompt_forward(runner, torch.tensor([tokens[20:22]]), logits=False).argmax is None
    step = runner.forward(torch.tensor([tokens[22:23]]))
    block = runner.forward(torch.tensor([tokens[23:28]]))
    parents, mask, depth = random_tree(6, gen)
    start = runner.cache_len
    tree = runner.forward(torch.tensor([tokens[:6]]), position_ids=torch.tensor([[start + d for d in depth]]),
                          tree_mask=mask)
    for name, o in (("step", step), ("block", block), ("tree", tree)):
        assert o.argmax == torch.argmax(o.logits[0], dim=-1).tolist() == o.choices(), name
    hf = HFRunner(model)
    hf.reset()
    plain = hf.forward(torch.tensor([tokens[:5]]))
    assert plain.argmax is None
    assert plain.choices() == torch.argmax(plain.logits[0], dim=-1).tolist()
    assert plain.last_choice() == int(torch.argmax(plain.logits[0, -1]))
    ties = RunnerOutput(logits=torch.tensor([[[0.0, 2.0, 2.0], [float("nan"), 1.0, float("nan")]]]))
    assert ties.choices() == [1, 0] and ties.last_choice() == 0  # torch's rule: the first maximum, the first NaN
