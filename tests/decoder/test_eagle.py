"""Method ``eagle``: an EAGLE feature drafter on the bundled target.

Greedy output equals plain decoding token for token (several prompts and γ, an EOS inside
an accepted chain, ``max_new_tokens`` landing inside a chain, a deadline that passes
mid-request); sampled output follows the target's distribution (chi-square on the joint
distribution of the first tokens, tiny 6-token model); the training forward's unrolled
chain steps compute what cached drafting computes; a sequence's `EagleCursor` feeds the real
entries kept in several chunks in one drafter step and drafts on the real entries only; the
EAGLE-1 checkpoint layout loads (an EAGLE-1 file with EAGLE-3 markers is read as a malformed
EAGLE-3 one, see test_eagle3.py); bad input gets clear errors. The drafter that accepts is trained for 120 steps on the
bundled target's own continuations (a few seconds, once per test process).
"""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch

from specops.decoder import Decoder, InvalidRequestError, MissingComponentError, VocabMismatchError
from specops.spec import eagle, speculation
from specops.models.eagle_io import EagleError, drafter_from_state, load_drafter, save_drafter
from specops.models.eagle_model import EagleDrafter
from specops.models.loading import load_runner
from specops.spec.sampling import SamplingConfig, probabilities
from tests.decoder.clocked import ClockedRunner, FakeClock
from tests.decoder.medusa_models import tiny_model
from tests.decoder.test_tree_sampling import chi_square
from tests.decoder.tiny_models import tiny_llama

ALPHA = 1e-3


@functools.lru_cache(maxsize=1)
def bundled_setup():
    """(target model, tokenizer, training prompts as ids, held-out prompts as ids, trained drafter)."""
    from specops.assets import TARGET_DIR
    from specops.train.checkpoint import load_causal_lm
    from specops.train.eagle import (EagleReport, EagleTrainConfig, collect, frequent_tokens, prompt_texts,
                                     train_drafter)
    from specops.train.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    model = load_causal_lm(TARGET_DIR)
    for p in model.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(TARGET_DIR)
    train_text, heldout_text = prompt_texts(tok)
    train_ids = [tok.encode(t, add_special_tokens=False)[-160:] for t in train_text]
    heldout_ids = [tok.encode(t, add_special_tokens=False)[-160:] for t in heldout_text]
    cfg = EagleTrainConfig(tokens=2000, new_tokens=64, seq_len=48, unroll=2, shortlist=512, steps=120, lr=2e-3,
                           progress=False)
    seqs = collect(Decoder(model), train_ids, cfg, eos=None, budget_s=120.0, progress=False)
    drafter = EagleDrafter.for_target(model, shortlist=frequent_tokens(seqs, cfg.shortlist, model.config.vocab_size),
                                      seed=0)
    with torch.no_grad():
        e = drafter.config.hidden_size
        drafter.fc.weight[:, e:] += torch.eye(e)
    train_drafter(drafter, seqs, cfg, budget_s=120.0, report=EagleReport())
    return model, tok, train_ids, heldout_ids, drafter


@pytest.fixture(scope="module")
def bundled():
    return bundled_setup()


@pytest.fixture(scope="module")
def decoder(bundled):
    model, tok, _, _, drafter = bundled
    return Decoder(model, eagle=drafter, tokenizer=tok)


def test_greedy_eagle_equals_plain_decoding_for_several_prompts_and_gammas(bundled, decoder):
    prompts = bundled[2][:3]
    accepted = 0
    for prompt in prompts:
        ref = decoder.generate(prompt, method="ar", max_new_tokens=40).tokens
        for gamma in (1, 2, 4, 7):
            out = decoder.generate(prompt, method="eagle", gamma=gamma, max_new_tokens=40)
            assert out.tokens == ref, gamma
            assert out.stats.method == "eagle" and out.stats.new_tokens == 40
            assert out.stats.target_forwards <= 41
            accepted += out.stats.accepted
    assert accepted > 60, "the trained drafter must have drafts accepted for this test to mean anything"


def spy_eos_cuts(monkeypatch) -> list[bool]:
    """Per committed step: whether an EOS among its accepted drafts cut it (`speculation.step_tokens`)."""
    cut_inside = []
    real = speculation.step_tokens

    def spy(accepted, next_token, drafted, eos):
        step = real(accepted, next_token, drafted, eos)
        cut_inside.append(len(step.emitted) <= len(accepted))
        return step

    monkeypatch.setattr(speculation, "step_tokens", spy)
    return cut_inside


def test_eos_inside_an_accepted_chain_ends_the_output_exactly(bundled, decoder, monkeypatch):
    cut_inside = spy_eos_cuts(monkeypatch)
    prompt = bundled[2][0]
    full = decoder.generate(prompt, method="ar", max_new_tokens=48).tokens
    for eos in sorted(set(full[4:40])):
        ref = full[: full.index(eos) + 1]
        cut_inside.clear()
        out = decoder.generate(prompt, method="eagle", gamma=5, max_new_tokens=48, eos_token_id=eos)
        assert out.tokens == ref and out.stats.stop_reason == "eos", eos
        if any(cut_inside):
            break
    assert any(cut_inside), "no EOS landed inside an accepted chain"


def test_max_new_tokens_inside_a_chain_is_exact(bundled, decoder):
    prompt = bundled[2][1]
    full = decoder.generate(prompt, method="ar", max_new_tokens=14).tokens
    for n in range(1, 15):
        out = decoder.generate(prompt, method="eagle", gamma=6, max_new_tokens=n)
        assert out.tokens == full[:n], n
        assert out.stats.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("shape", [{"gamma": 4}, {"eagle_tree": (4, 3, 10)}], ids=["chain", "tree"])
def test_deadline_mid_request_continues_plainly_and_exactly(bundled, monkeypatch, shape):
    model, _, prompts, _, drafter = bundled
    clock = FakeClock()
    clock.install(monkeypatch)
    runner = ClockedRunner(load_runner(model), clock)
    dec = Decoder(runner, eagle=drafter)
    ref = dec.generate(prompts[0], method="ar", max_new_tokens=24).tokens
    for deadline_s in (2.5, 4.5, 6.5):
        start = len(runner.log)
        out = dec.generate(prompts[0], method="eagle", max_new_tokens=24, deadline_s=deadline_s, **shape)
        assert out.tokens == ref, deadline_s
        assert out.stats.fallback_reason == "deadline"
        steps = runner.log[start + 1:]
        deadline = runner.log[start].start + deadline_s
        assert any(f.width > 1 for f in steps if f.start < deadline), "no speculation before the deadline"
        assert all(f.width == 1 for f in steps if f.start > deadline)
    on_time = dec.generate(prompts[0], method="eagle", max_new_tokens=24, deadline_s=3600.0, **shape)
    assert on_time.tokens == ref and on_time.stats.fallback_reason is None


def test_unrolled_training_forward_matches_cached_chain_drafting():
    model = tiny_llama(seed=5)
    drafter = EagleDrafter.for_target(model, seed=1, input_layernorm=True).eval()
    drafter.kernel_weights = "fp32"  # the module's training forward against the packed inference path
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    tokens, feats = torch.randint(0, 96, (1, 10)), torch.randn(1, 10, 32)
    with torch.no_grad():
        outs = drafter(tokens, feats, steps=3)
        drafter.reset()
        whole = drafter.step(tokens[0], feats[0])
        drafter.reset()
        real = drafter.step(tokens[0, :6], feats[0, :6])  # entries 0..5 real
        first = drafter.step(tokens[0, 6:7], real[-1:])  # entry 6 reads its own prediction
        second = drafter.step(tokens[0, 7:8], first)
    torch.testing.assert_close(whole, outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[0], outs[1][0, 6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], outs[2][0, 7], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- the per-sequence cursor
def check_cursor(drafter, width: int, monkeypatch) -> None:
    """An `eagle.EagleCursor` on ``drafter`` (features ``width`` wide): entries kept in several chunks
    are fed in one drafter step and predict what one feed of them all predicts (and, to rounding,
    what feeding them chunk by chunk predicts); a chain and a tree leave its cache at the real
    entries and draft what a cache fed at once drafts; the tree's depth is cut to its cache; `stop`
    and `clear` drop its state."""
    from specops.spec.eagle_tree import EagleTree, draft_tree

    g = torch.Generator().manual_seed(0)
    vocab, cpu, greedy = drafter.config.vocab_size, torch.device("cpu"), SamplingConfig()
    tokens = torch.randint(vocab, (13,), generator=g).tolist()  # x_0 .. x_12, x_12 pending
    features = torch.randn(12, width, generator=g)  # f_0 .. f_11: entry i reads (x_{i+1}, f_i)
    chunks = ((0, 5), (5, 6), (6, 12))
    steps = []
    real_step = drafter.step

    def counted(*args, **kwargs):
        steps.append(args[0].shape[0])
        return real_step(*args, **kwargs)

    with torch.no_grad():
        whole = eagle.EagleCursor(drafter, 40)
        whole.keep(tokens[1:], features)
        assert whole.catch_up()
        stepwise = eagle.EagleCursor(drafter, 40)
        for a, b in chunks:
            stepwise.keep(tokens[a + 1 : b + 1], features[a:b])
            assert stepwise.catch_up() and stepwise.fed == b
        cursor = eagle.EagleCursor(drafter, 40)
        assert not cursor.ready and not cursor.catch_up() and cursor.cache is None
        for a, b in chunks:
            cursor.keep(tokens[a + 1 : b + 1], features[a:b])
        assert cursor.ready and (cursor.fed, cursor.unfed, cursor.known) == (0, 12, 12) and cursor.cache is None
        monkeypatch.setattr(drafter, "step", counted)
        assert cursor.catch_up()
        assert steps == [12] and cursor.waiting == [] and (cursor.fed, cursor.cache.length) == (12, 12)
        assert cursor.catch_up() and steps == [12]  # nothing waiting: no drafter forward
        monkeypatch.undo()
        assert torch.equal(cursor.last, whole.last)
        assert torch.equal(cursor.cache.data[..., :12, :], whole.cache.data[..., :12, :])
        torch.testing.assert_close(stepwise.last, whole.last, atol=1e-4, rtol=1e-4)

        reference = drafter.new_cache(40)
        last = drafter.step(torch.tensor(tokens[1:]), features, reference)[-1]
        want, _ = eagle.draft_chain(drafter, last, 4, greedy, g, vocab, cpu, reference)
        assert reference.length == 12 + 3  # draft_chain left its drafted entries
        drafted, q = cursor.chain(4, greedy, g, vocab, cpu)
        assert drafted == want and q is None and (cursor.fed, cursor.cache.length) == (12, 12)
        assert cursor.chain(4, greedy, g, vocab, cpu)[0] == want  # the drafted entries were cut off

        shape = EagleTree(depth=3, topk=2, tree_size=6)
        reference.truncate(12)
        want_tree, want_forwards = draft_tree(drafter, last, tokens[-1], shape, 3, 6, cpu, reference)
        estimates: list[float] = []
        assert cursor.depth_room(3, shape.topk) == 3
        tree, forwards = cursor.tree(shape, 3, 6, tokens[-1], cpu, estimates)
        assert forwards == want_forwards == 2 and torch.equal(tree.tokens, want_tree.tokens)
        assert len(estimates) == 5 and cursor.cache.length == 12

        small = eagle.EagleCursor(drafter, 15)  # 3 entries past the 12 real ones: one expanded level
        small.keep(tokens[1:], features)
        assert small.catch_up() and small.depth_room(3, shape.topk) == 2 and small.depth_room(1, shape.topk) == 1
        small.tree(shape, 2, 6, tokens[-1], cpu)
        assert small.cache.length == 12

        small.clear()
        assert (small.cache, small.fed, small.last, small.waiting, small.in_step) == (None, 0, None, [], True)
        cursor.keep(tokens[1:2], features[:1])
        cursor.stop()
        assert cursor.cache is None and cursor.waiting == [] and not cursor.in_step
        cursor.keep(tokens[1:], features)
        assert not cursor.ready and not cursor.catch_up() and cursor.cache is None


def test_the_cursor_feeds_kept_entries_in_one_step_and_drafts_on_the_real_entries_only(monkeypatch):
    model = tiny_llama(seed=5)
    drafter = EagleDrafter.for_target(model, seed=1, input_layernorm=True).eval()
    drafter.kernel_weights = "fp32"  # one feed against chunk by chunk: fp32 rounding only
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    check_cursor(drafter, model.config.hidden_size, monkeypatch)


# ---------------------------------------------------------------------- sampling
VOCAB, LENGTH = 6, 3
PROMPT = [1, 4, 2, 1, 4]
SAMPLING = SamplingConfig(temperature=0.9, top_k=5)


def _exact(model) -> dict[tuple[int, ...], float]:
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.cat([torch.tensor([PROMPT]).expand(len(seqs), -1), torch.tensor(seqs)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    probs = probabilities(logits[:, len(PROMPT) - 1 : -1], SAMPLING).double()
    exact = probs.gather(2, torch.tensor(seqs)[:, :, None])[:, :, 0].prod(dim=1)
    return {s: float(e) for s, e in zip(seqs, exact) if e > 0}


def _sample_counts(trials: int) -> tuple[dict[tuple[int, ...], int], int, object]:
    torch.set_num_threads(1)
    model = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    drafter = EagleDrafter.for_target(model, seed=2, shortlist=[0, 1, 2, 4])  # q is 0 on tokens 3 and 5
    dec = Decoder(model, eagle=drafter)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for i in range(trials):
        out = dec.generate(PROMPT, method="eagle", gamma=3, max_new_tokens=LENGTH, temperature=SAMPLING.temperature,
                           top_k=SAMPLING.top_k, seed=i)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        accepted += out.stats.accepted
    return counts, accepted, model


def test_sampled_eagle_follows_the_target_distribution():
    trials = 1200
    counts, accepted, model = _sample_counts(trials)
    assert accepted > trials // 4, "drafts must be accepted for this test to mean anything"
    assert chi_square(counts, _exact(model), trials) > ALPHA


def test_the_distribution_check_rejects_drafts_verified_against_the_wrong_q(monkeypatch):
    real = eagle.draft_chain

    def uniform_q(*args, **kwargs):
        drafted, q = real(*args, **kwargs)
        return drafted, torch.full_like(q, 1.0 / q.shape[-1])

    monkeypatch.setattr(eagle, "draft_chain", uniform_q)
    trials = 1200
    counts, _, model = _sample_counts(trials)
    assert chi_square(counts, _exact(model), trials) < ALPHA


def test_sampled_eagle_is_reproducible_with_a_seed(bundled, decoder):
    prompt = bundled[2][2]
    a = decoder.generate(prompt, method="eagle", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    b = decoder.generate(prompt, method="eagle", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    assert a.tokens == b.tokens and len(a.tokens) == 20


# ---------------------------------------------------------------------- checkpoints
def _eagle1_state(model, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """A synthetic checkpoint in EAGLE-1's layout for ``model`` (config.json dict, state dict)."""
    c = model.config
    e, inter, heads, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    d = e // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {
        "fc.weight": rnd(e, 2 * e), "fc.bias": rnd(e),
        "layers.0.self_attn.q_proj.weight": rnd(heads * d, e), "layers.0.self_attn.k_proj.weight": rnd(kv * d, e),
        "layers.0.self_attn.v_proj.weight": rnd(kv * d, e), "layers.0.self_attn.o_proj.weight": rnd(e, heads * d),
        "layers.0.mlp.gate_proj.weight": rnd(inter, e), "layers.0.mlp.up_proj.weight": rnd(inter, e),
        "layers.0.mlp.down_proj.weight": rnd(e, inter), "layers.0.post_attention_layernorm.weight": 1 + rnd(e),
        "embed_tokens.weight": rnd(c.vocab_size, e),
    }
    config = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": e,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "max_position_embeddings": 2048, "model_type": "llama",
              "rms_norm_eps": 1e-6, "vocab_size": c.vocab_size, "torch_dtype": "float16", "bias": True}
    return config, state


def test_eagle1_checkpoint_layout_loads_onto_the_drafter(tmp_path):
    model = tiny_llama(seed=4)
    config, state = _eagle1_state(model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save({k: v.half() for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    drafter = load_drafter(tmp_path, base=model)
    assert not drafter.config.input_layernorm and drafter.config.fc_bias and drafter.config.shortlist_size == 0
    loaded = drafter.state_dict()
    for name, tensor in state.items():
        if name != "embed_tokens.weight":
            torch.testing.assert_close(loaded[name], tensor.half().float())
    dec = Decoder(model, eagle=drafter)
    prompt = [3, 17, 41, 5, 60]
    ref = dec.generate(prompt, method="ar", max_new_tokens=16).tokens
    assert dec.generate(prompt, method="eagle", gamma=3, max_new_tokens=16).tokens == ref


def test_mixed_and_mismatched_checkpoints_are_refused():
    model = tiny_llama(seed=4)
    config, state = _eagle1_state(model)
    with pytest.raises(EagleError, match=r"EAGLE-3\)?: tensors do not match EAGLE-3's layout"):
        drafter_from_state({**config, "draft_vocab_size": 32}, state)
    with pytest.raises(EagleError, match=r"EAGLE-3\)?: tensors do not match EAGLE-3's layout"):
        drafter_from_state(config, {**state, "d2t": torch.zeros(32, dtype=torch.long)})
    with pytest.raises(EagleError, match="missing.*o_proj"):
        drafter_from_state(config, {k: v for k, v in state.items() if "o_proj" not in k})
    with pytest.raises(EagleError, match="only 1-layer"):
        drafter_from_state({**config, "num_hidden_layers": 2}, state)


def test_saved_drafter_round_trips_through_from_pretrained(bundled, tmp_path):
    model, _, prompts, _, drafter = bundled
    save_drafter(drafter, tmp_path / "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["specops_eagle"]["shortlist_size"] == 512
    dec = Decoder.from_pretrained("bundled", eagle=tmp_path / "eagle")
    assert torch.equal(dec.eagle.shortlist, drafter.shortlist)
    ref = dec.generate(prompts[0], method="ar", max_new_tokens=24).tokens
    out = dec.generate(prompts[0], method="eagle", max_new_tokens=24)
    assert out.tokens == ref and out.stats.accepted > 0


# ---------------------------------------------------------------------- errors
def test_bad_input_gets_clear_errors(bundled, decoder):
    model, _, prompts, _, drafter = bundled
    with pytest.raises(InvalidRequestError, match="gamma must be >= 1"):
        decoder.generate(prompts[0], method="eagle", gamma=0)
    plain = Decoder(model)
    with pytest.raises(MissingComponentError, match="specops train eagle --model"):
        plain.generate(prompts[0], method="eagle")
    with pytest.raises(InvalidRequestError, match="unknown option"):
        decoder.generate(prompts[0], method="eagle", max_ngram=3)
    with pytest.raises(VocabMismatchError):
        Decoder(tiny_llama(seed=1), eagle=EagleDrafter.for_target(model, seed=0))
    with pytest.raises(InvalidRequestError, match="eagle must be an EagleDrafter"):
        Decoder(model, eagle="not a drafter")
    unbound = EagleDrafter(drafter.config)
    with pytest.raises(InvalidRequestError, match="bound"):
        Decoder(load_runner(model), eagle=unbound)
    with pytest.raises(Exception, match="not an EAGLE drafter folder"):
        Decoder.from_pretrained("bundled", eagle="/nonexistent/eagle")


def test_packed_inference_copies_compute_what_the_module_computes():
    """At inference the drafter runs its products through the C kernels' packed copies
    (`EagleDrafter.packed`): the same features and logits as the module's own path, never in
    training or with autograd on, and made anew after a weight changes in place."""
    from specops.kernels import cpu_linear

    assert cpu_linear.available(), cpu_linear.unavailable_reason()  # CI builds the kernels: never a skip
    model = tiny_llama()
    drafter = EagleDrafter.for_target(model, shortlist=list(range(0, 64, 2)), seed=3).eval()
    drafter.kernel_weights = "fp32"
    tokens, feats = torch.randint(0, 64, (9,)), torch.randn(9, model.config.hidden_size)

    def run(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            if not packed:
                drafter.packed = lambda: None  # the module's own path
            try:
                drafter.reset()
                out = drafter.step(tokens, feats)
                return out, drafter.logits(out)
            finally:
                if not packed:
                    del drafter.packed

    (a, la), (b, lb) = run(True), run(False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        assert drafter.packed() is not None
    with torch.no_grad():
        drafter.layers[0].mlp.down_proj.weight.mul_(2.0)
    (c, _), (d, _) = run(True), run(False)
    torch.testing.assert_close(c, d, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(c, a)
    assert drafter.packed() is None  # autograd on
    drafter.kernel_weights = "bf16"  # half the bytes per product: the same values to bf16 rounding
    (e, le), (f, lf) = run(True), run(False)
    torch.testing.assert_close(e, f, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(le, lf, atol=3e-2, rtol=3e-2)
    with torch.inference_mode():
        assert drafter.packed().head.weight.dtype == (torch.bfloat16 if cpu_linear.bf16_weights() else torch.float32)
    with pytest.raises(EagleError, match="kernel_weights"):
        drafter.kernel_weights = "fp16"
    drafter.train()
    with torch.inference_mode():
        assert drafter.packed() is None  # training


def test_the_drafter_runs_its_torch_ops_on_one_thread_and_restores_the_count(bundled, monkeypatch):
    """torch's OpenMP team would spin on the cores the target's next forward needs (`torch_single_thread`)."""
    from specops.spec import eagle

    model, _, prompts, _, drafter = bundled
    seen = []
    step = type(drafter).step

    def counted(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "step", counted)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = Decoder(model, eagle=drafter).generate(prompts[0], method="eagle", max_new_tokens=16)
        assert out.stats.accepted > 0 and seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        with eagle.torch_single_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
