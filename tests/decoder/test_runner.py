"""Runners against transformers' own forward: the generic HFRunner, load_runner's choice,
input validation, and the KVCache. FastLlamaRunner's exactness is in test_runner_fast.py;
both reuse `run_scenario` below.

Reference for every check: transformers' forward over the whole token sequence the
runner's cache is supposed to hold, with no cache at all."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specops.models.hf_runner import HFRunner
from specops.models.kv_cache import KVCache
from specops.models.runner import ModelRunner, RunnerOutput, UnsupportedModelError
from specops.models.loading import load_runner

VOCAB = 64
ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared, busy 2-core machine: OpenMP thread hand-offs cost far more
    than the arithmetic (15 ms per 32x48 linear measured), so these tests run single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize(model, seed: int, std: float = 0.15):
    """Random values for every parameter (norm weights and biases too, so they all matter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if p.dim() == 1 and (p == 1).all() else 0.0))
    return model.eval()


def build(model_type: str, seed: int = 0, **overrides):
    """A tiny random-weight causal LM of the given architecture."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if model_type == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
        cls = tf.GPT2LMHeadModel
    elif model_type == "gpt_neox":
        cfg = tf.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, **common,
        )
        cls = tf.GPTNeoXForCausalLM
    else:
        kw = dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **common,
        )
        kw.update(overrides)
        overrides = {}
        cfg_cls, cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[model_type]
        cfg = cfg_cls(**kw)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    return randomize(cls(cfg), seed)


@torch.no_grad()
def reference(model, tokens: list[int]) -> torch.Tensor:  # -> [len(tokens), V]
    return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()


@torch.no_grad()
def reference_hidden(model, tokens: list[int]) -> torch.Tensor:  # -> [len(tokens), E]
    ids = torch.tensor([tokens], device=model.device)
    return model(ids, output_hidden_states=True).hidden_states[-1][0].float().cpu()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), f"{what}: max abs error {err:.3g}"


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, list[int]]:
    """Parents (topologically ordered, -1 = child of the prefix), the [n, n] ancestor-or-self
    mask, and each node's depth."""
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i in range(n):
        j, d = i, 0
        while j >= 0:
            mask[i, j] = True
            j, d = parents[j], d + 1
        depth.append(d - 1)
    return parents, mask, depth


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def run_scenario(runner: ModelRunner, model, seed: int = 0, tree_nodes: int = 7, keep_as_list: bool = False) -> None:
    """Prefill, single steps, a multi-token step on a prefix, truncate, a tree forward with a
    random tree and custom position ids, compact to a root-to-leaf path (given as a list of
    ints with ``keep_as_list``, as Medusa decoding passes it), and more steps — each result
    compared with transformers' forward over the implied sequence."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    runner.reset()
    seq = tokens(7)
    out = runner.forward(torch.tensor([seq]))
    assert isinstance(out, RunnerOutput) and out.logits.dtype == torch.float32
    close(out.logits[0], reference(model, seq), "prefill")
    assert runner.cache_len == 7

    for step in range(2):
        tok = tokens(1)
        out = runner.forward(torch.tensor([tok]))
        seq += tok
        close(out.logits[0], reference(model, seq)[-1:], f"single step {step}")

    chunk = tokens(4)
    out = runner.forward(torch.tensor([chunk]), need_hidden=True)
    seq += chunk
    close(out.logits[0], reference(model, seq)[-4:], "4 new positions after a prefix")
    close(out.hidden[0], reference_hidden(model, seq)[-4:], "hidden after the final norm")

    runner.truncate(len(seq) - 3)
    seq = seq[:-3]
    assert runner.cache_len == len(seq)
    tok = tokens(1)
    out = runner.forward(torch.tensor([tok]))
    seq += tok
    close(out.logits[0], reference(model, seq)[-1:], "step after truncate")

    parents, tree_mask, depth = random_tree(tree_nodes, gen)
    nodes = tokens(tree_nodes)
    prefix = len(seq)
    positions = torch.tensor([[prefix + d for d in depth]])
    out = runner.forward(torch.tensor([nodes]), position_ids=positions, tree_mask=tree_mask)
    assert runner.cache_len == prefix + tree_nodes
    for i in range(tree_nodes):
        path = [nodes[j] for j in path_to(i, parents)]
        close(out.logits[0, i], reference(model, seq + path)[-1], f"tree node {i} (parents {parents})")

    leaf = max(range(tree_nodes), key=lambda i: (depth[i], i))
    keep = path_to(leaf, parents)
    runner.compact(prefix, keep if keep_as_list else torch.tensor(keep))
    seq += [nodes[j] for j in keep]
    assert runner.cache_len == len(seq)
    more = tokens(2)
    out = runner.forward(torch.tensor([more]))
    seq += more
    close(out.logits[0], reference(model, seq)[-2:], f"steps after compacting path {keep}")


# --------------------------------------------------------------------------- HFRunner


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama", "qwen2"])
def test_hf_runner_matches_transformers(model_type):
    model = build(model_type, seed=3)
    runner = HFRunner(model)
    assert isinstance(runner, ModelRunner)
    run_scenario(runner, model, seed=5)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hf_runner_tree_mask_with_eager_attention(model_type):
    """Eager attention adds the 4-D mask to the scores itself (SDPA is the default above)."""
    model = build(model_type, seed=8)
    model.set_attn_implementation("eager")
    run_scenario(HFRunner(model), model, seed=9, tree_nodes=5)


def test_hf_runner_sliding_window_model_decodes_past_the_window():
    model = build("mistral", seed=4, sliding_window=6)
    runner = HFRunner(model)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
    runner.forward(torch.tensor([seq]))
    for _ in range(6):
        tok = torch.randint(0, VOCAB, (1,), generator=gen).tolist()
        out = runner.forward(torch.tensor([tok]))
        seq += tok
        close(out.logits[0], reference(model, seq)[-1:], f"sliding-window step at length {len(seq)}")
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        runner.forward(torch.tensor([[1, 2]]), tree_mask=torch.ones(2, 2, dtype=torch.bool).tril())


def test_hf_runner_batch_of_two():
    model = build("gpt2", seed=6)
    runner = HFRunner(model)
    runner.reset(batch_size=2)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    runner.forward(ids[:, :4])
    out = runner.forward(ids[:, 4:])
    with torch.no_grad():
        want = model(ids).logits[:, 4:]
    close(out.logits, want, "batch of two")


# --------------------------------------------------------------------------- load_runner


def test_load_runner_picks_the_implementation():
    from specops.models.fast_llama import FastLlamaRunner

    for model_type in ("llama", "mistral", "qwen2"):
        assert isinstance(load_runner(build(model_type)), FastLlamaRunner), model_type
    for model_type in ("gpt2", "gpt_neox"):
        assert isinstance(load_runner(build(model_type)), HFRunner), model_type
    llama = build("llama")
    assert isinstance(load_runner(llama, impl="hf"), HFRunner)
    assert isinstance(load_runner(llama, impl="fast"), FastLlamaRunner)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_runner(build("gpt2"), impl="fast")
    with pytest.raises(ValueError, match="impl must be one of"):
        load_runner(llama, impl="turbo")


def test_load_runner_falls_back_to_hf_for_what_the_fast_path_cannot_run():
    from specops.models.fast_llama import FastLlamaRunner

    windowed = build("mistral", sliding_window=16)
    # default context stops at the window, where sliding-window attention is plain causal
    fast = load_runner(windowed)
    assert isinstance(fast, FastLlamaRunner) and fast.max_context == 16
    # a longer context than the window needs the generic path
    assert isinstance(load_runner(windowed, max_context=64), HFRunner)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        load_runner(windowed, max_context=64, impl="fast")
    dynamic = build("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert isinstance(load_runner(dynamic), HFRunner)


def test_max_context_is_checked_against_the_model():
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        load_runner(build("llama"), max_context=65)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        load_runner(build("gpt2"), max_context=65)
    assert load_runner(build("gpt2"), max_context=20).max_context == 20


# --------------------------------------------------------------------------- bad input


@pytest.fixture(params=["fast", "hf"])
def small_runner(request):
    return load_runner(build("llama", seed=2), max_context=16, impl=request.param)


def test_compact_edge_cases_keep_the_cache_consistent(small_runner):
    model = small_runner.model
    seq = list(range(1, 11))
    small_runner.forward(torch.tensor([seq]))
    small_runner.compact(10, torch.tensor([], dtype=torch.long))  # nothing after the end: no-op
    assert small_runner.cache_len == 10
    small_runner.compact(7, torch.tensor([0, 1, 2]))  # identity path: nothing moves
    assert small_runner.cache_len == 10
    small_runner.compact(6, torch.tensor([], dtype=torch.long))  # keep nothing after 6
    assert small_runner.cache_len == 6
    out = small_runner.forward(torch.tensor([[20, 21]]))
    seq = seq[:6] + [20, 21]
    close(out.logits[0], reference(model, seq)[-2:], "after compacting to nothing")


def test_truncate_to_zero_and_reset_start_over(small_runner):
    model = small_runner.model
    small_runner.forward(torch.tensor([[5, 6, 7, 8]]))
    small_runner.truncate(0)
    assert small_runner.cache_len == 0
    out = small_runner.forward(torch.tensor([[9, 10, 11]]))
    close(out.logits[0], reference(model, [9, 10, 11]), "after truncate(0)")
    small_runner.reset()
    assert small_runner.cache_len == 0
    out = small_runner.forward(torch.tensor([[12, 13]]))
    close(out.logits[0], reference(model, [12, 13]), "after reset()")


def test_forward_beyond_max_context_is_rejected(small_runner):
    small_runner.forward(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_context 16"):
        small_runner.forward(torch.zeros(1, 7, dtype=torch.long))
    assert small_runner.cache_len == 10  # a rejected forward leaves the cache alone
    small_runner.forward(torch.zeros(1, 6, dtype=torch.long))
    assert small_runner.cache_len == 16


def test_compact_out_of_range_is_rejected(small_runner):
    small_runner.forward(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"keep offsets must lie in \[0, 3\)"):
        small_runner.compact(5, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"keep offsets must lie"):
        small_runner.compact(5, torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"start must be in \[0, 8\]"):
        small_runner.compact(9, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"shape \[n\]"):
        small_runner.compact(5, torch.tensor([[0]]))
    for bad in ([0, 3], [-1]):  # a list (how Medusa decoding passes its path) is checked alike
        with pytest.raises(ValueError, match=r"keep offsets must lie"):
            small_runner.compact(5, bad)
    assert small_runner.cache_len == 8


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda r: r.forward(torch.zeros(4, dtype=torch.long)), r"shape \[B, T\]"),
        (lambda r: r.forward(torch.zeros(1, 0, dtype=torch.long)), r"no positions"),
        (lambda r: r.forward(torch.zeros(1, 2)), r"integer tensor"),
        (lambda r: r.forward(torch.zeros(2, 2, dtype=torch.long)), r"reset\(batch_size=2\)"),
        (lambda r: r.forward(torch.zeros(1, 2, dtype=torch.long), tree_mask=torch.ones(3, 3, dtype=torch.bool)),
         r"tree_mask must have shape \[T, T\]"),
        (lambda r: r.forward(torch.zeros(1, 2, dtype=torch.long), tree_mask=torch.ones(2, 2)), r"bool tensor"),
        (lambda r: r.forward(torch.zeros(1, 2, dtype=torch.long), tree_mask=torch.zeros(2, 2, dtype=torch.bool)),
         r"diagonal"),
        (lambda r: r.forward(torch.zeros(1, 2, dtype=torch.long), position_ids=torch.tensor([[0, 16]])),
         r"position_ids must lie in \[0, 16\)"),
        (lambda r: r.forward(torch.zeros(1, 2, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2]])),
         r"position_ids must have shape"),
        (lambda r: r.truncate(1), r"truncate length must be in \[0, 0\]"),
        (lambda r: r.reset(0), r"batch_size must be a positive int"),
    ],
)
def test_bad_input_raises_a_clear_error(small_runner, call, message):
    with pytest.raises(ValueError, match=message):
        call(small_runner)


# --------------------------------------------------------------------------- KVCache


def test_kv_cache_compact_moves_rows_in_every_layer():
    cache = KVCache(layers=2, kv_heads=1, head_dim=2, max_len=10, dtype=torch.float32, device=torch.device("cpu"))
    rows = torch.arange(8, dtype=torch.float32)  # row r holds value r
    kv = rows.view(1, 1, 8, 1).expand(2, 1, 1, 8, 2).clone()  # [2, B, Hkv, T, D]
    for layer in range(2):
        cache.write(layer, kv * (layer + 1))
    cache.advance(8)
    # overlapping source and destination, not monotonic
    cache.compact(2, torch.tensor([6, 3, 7]))
    assert cache.length == 5
    for layer in range(2):
        keys = cache.keys[layer][0, 0, :5, 0]
        assert keys.tolist() == [v * (layer + 1) for v in (0, 1, 6, 3, 7)]
    with pytest.raises(ValueError, match="overflow"):
        cache.advance(6)
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError, match="truncate length"):
        cache.truncate(2)


# --------------------------------------------------------------------------- random op sequences

_MODELS: dict[str, object] = {}


def _model(name: str):
    if name not in _MODELS:
        _MODELS[name] = build("llama", seed=51) if name == "llama" else build("gpt2", seed=53)
    return _MODELS[name]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), impl=st.sampled_from(["fast-llama", "hf-gpt2"]))
def test_random_operation_sequences_match_transformers(data, impl):
    """Any interleaving of steps, rollbacks and tree forwards with compaction leaves the cache
    equal to a plain forward over the tokens it should hold."""
    model = _model("llama" if impl == "fast-llama" else "gpt2")
    runner = load_runner(model, max_context=40, impl="fast" if impl == "fast-llama" else "hf")
    seq: list[int] = []
    token = st.integers(0, VOCAB - 1)
    for _ in range(data.draw(st.integers(1, 6), label="ops")):
        room = runner.max_context - len(seq)
        op = data.draw(st.sampled_from(["step", "truncate", "tree"]) if seq else st.just("step"), label="op")
        if op == "truncate":
            keep = data.draw(st.integers(0, len(seq)), label="truncate to")
            runner.truncate(keep)
            seq = seq[:keep]
        elif op == "step" and room > 0:
            new = data.draw(st.lists(token, min_size=1, max_size=min(5, room)), label="tokens")
            out = runner.forward(torch.tensor([new]))
            seq += new
            close(out.logits[0], reference(model, seq)[-len(new):], f"step of {len(new)}")
        elif op == "tree" and room > 0:
            n = data.draw(st.integers(1, min(6, room)), label="nodes")
            parents = [-1] + [data.draw(st.integers(-1, i - 1), label="parent") for i in range(1, n)]
            mask = torch.zeros(n, n, dtype=torch.bool)
            depth = []
            for i in range(n):
                j, d = i, 0
                while j >= 0:
                    mask[i, j] = True
                    j, d = parents[j], d + 1
                depth.append(d - 1)
            nodes = data.draw(st.lists(token, min_size=n, max_size=n), label="node tokens")
            prefix = len(seq)
            out = runner.forward(
                torch.tensor([nodes]), position_ids=torch.tensor([[prefix + d for d in depth]]), tree_mask=mask
            )
            target = data.draw(st.integers(0, n - 1), label="accepted node")
            path = path_to(target, parents)
            close(out.logits[0, target], reference(model, seq + [nodes[j] for j in path])[-1], "tree node")
            runner.compact(prefix, torch.tensor(path))
            seq += [nodes[j] for j in path]
        assert runner.cache_len == len(seq)
    if seq and len(seq) < runner.max_context:
        out = runner.forward(torch.tensor([[1]]))
        close(out.logits[0, -1], reference(model, seq + [1])[-1], "final step")
