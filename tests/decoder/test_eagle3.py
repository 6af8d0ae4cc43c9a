"""Method ``eagle`` with a published EAGLE-3 checkpoint (`specops.models.eagle3_model`).

Synthetic checkpoints are written with EAGLE-3's tensor names and config keys (``fc`` over
three fused target layers, ``midlayer.*``, its own ``norm`` and ``lm_head`` over a reduced
vocabulary, ``d2t`` / ``t2d``) for tiny random Llama targets. They load (safetensors and
pytorch_model.bin); the drafter reads the target's hidden states of the layers EAGLE-3 fuses
(its default for the target's depth, or those its config names), at the positions EAGLE-1's
features would be; greedy output equals plain decoding; sampled output follows the target's
distribution; it runs through the per-sequence `EagleCursor` as an EAGLE-1 drafter does; a
drafter built to draft the target's own choices has its chains accepted; malformed
checkpoints get an `EagleError` naming the problem; the fast runner refuses such a drafter
while ``impl="auto"`` runs the target through transformers.
"""

from __future__ import annotations

import json

import pytest
import torch

from specops.decoder import Decoder, InvalidRequestError
from specops.spec.eagle import generate_eagle
from specops.models.eagle3_model import Eagle3Drafter
from specops.models.eagle_io import EagleError, drafter_from_state, is_eagle3_dir, load_drafter
from specops.models.hf_runner import HFRunner
from specops.models.loading import load_runner
from specops.spec.sampling import SamplingConfig, make_generator
from tests.decoder.medusa_models import tiny_model
from tests.decoder.test_eagle import ALPHA, LENGTH, PROMPT, SAMPLING, VOCAB, _exact, check_cursor
from tests.decoder.test_tree_sampling import chi_square
from tests.decoder.tiny_models import tiny_llama

LAYERS = 8  # EAGLE-3's default layers of an 8-layer target: hidden_states 2, 4 and 5


def eagle3_checkpoint(model, draft_ids: list[int] | None = None, *, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                      scale: float = 0.2, **config) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random EAGLE-3 checkpoint for ``model`` in the published layout: (config.json dict, state dict).
    ``draft_ids``: the target tokens drafted over (None: the whole vocabulary, no d2t / t2d)."""
    c = model.config
    e, v = c.hidden_size, c.vocab_size
    d, inter = e // heads, 2 * e
    f = v if draft_ids is None else len(draft_ids)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    state = {
        "fc.weight": rnd(e, 3 * e),
        "midlayer.self_attn.q_proj.weight": rnd(heads * d, 2 * e),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * d, 2 * e),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * d, 2 * e),
        "midlayer.self_attn.o_proj.weight": rnd(e, heads * d),
        "midlayer.mlp.gate_proj.weight": rnd(inter, e), "midlayer.mlp.up_proj.weight": rnd(inter, e),
        "midlayer.mlp.down_proj.weight": rnd(e, inter), "midlayer.hidden_norm.weight": 1 + rnd(e),
        "midlayer.input_layernorm.weight": 1 + rnd(e), "midlayer.post_attention_layernorm.weight": 1 + rnd(e),
        "norm.weight": 1 + rnd(e), "lm_head.weight": rnd(f, e),
    }
    if draft_ids is not None:
        ids = torch.tensor(draft_ids)
        state["d2t"] = ids - torch.arange(f)
        state["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": e,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "vocab_size": v,
           "draft_vocab_size": f, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
           "torch_dtype": "float16", **config}
    return cfg, state


def write_checkpoint(path, config: dict, state: dict[str, torch.Tensor], *, legacy: bool = False):
    """``config.json`` + fp16 ``model.safetensors`` (``legacy``: ``pytorch_model.bin``) in ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    half = {k: t.half() if t.is_floating_point() else t for k, t in state.items()}
    if legacy:
        torch.save(half, path / "pytorch_model.bin")
    else:
        save_file(half, str(path / "model.safetensors"))
    return path


def draft_ids_of(vocab: int, count: int, seed: int = 0) -> list[int]:
    return sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def fused(model, tokens: list[int], layers) -> torch.Tensor:
    """[T, 3E]: the target's hidden_states ``layers`` over ``tokens`` side by side (one plain forward)."""
    with torch.no_grad():
        states = model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=4, layers=LAYERS)


@pytest.fixture(scope="module")
def drafter(target):
    cfg, state = eagle3_checkpoint(target, draft_ids_of(target.config.vocab_size, 48))
    return drafter_from_state(cfg, state).bind(target).eval()


# ---------------------------------------------------------------------- loading
@pytest.mark.parametrize("legacy", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_eagle3_checkpoint_in_the_published_layout_loads(target, tmp_path, legacy):
    ids = draft_ids_of(target.config.vocab_size, 48)
    config, state = eagle3_checkpoint(target, ids)
    folder = write_checkpoint(tmp_path / "eagle3", config, state, legacy=legacy)
    assert is_eagle3_dir(folder) and not is_eagle3_dir(tmp_path / "missing")
    drafter = load_drafter(folder, base=target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.reads_layers
    assert drafter.feature_layers == (2, LAYERS // 2, LAYERS - 3)
    assert drafter.shortlist.tolist() == ids  # draft token k is target token k + d2t[k]
    loaded = drafter.state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor.half().float() if tensor.is_floating_point() else tensor)
    with torch.no_grad():
        drafter.reset()
        feats = drafter.step(torch.tensor([3, 9]), torch.randn(2, 3 * target.config.hidden_size))
    assert tuple(drafter.logits(feats).shape) == (2, 48)


def test_an_eagle3_drafter_runs_through_the_per_sequence_cursor(target, drafter, monkeypatch):
    """Its `new_cache` and `step` on fused target features serve `eagle.EagleCursor` as an EAGLE-1 drafter's do."""
    check_cursor(drafter, 3 * target.config.hidden_size, monkeypatch)


def test_save_drafter_writes_eagle1_drafters_only(drafter, tmp_path):
    from specops.models.eagle_io import save_drafter

    with pytest.raises(EagleError, match="save_drafter writes EAGLE-1 drafters"):
        save_drafter(drafter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_full_draft_vocabulary_needs_no_vocabulary_maps(target):
    config, state = eagle3_checkpoint(target, None)
    drafter = drafter_from_state(config, state).bind(target)
    assert drafter.shortlist is None and bool(drafter.t2d.all())


# ---------------------------------------------------------------------- decoding
def test_auto_runs_the_target_through_transformers_and_greedy_eagle3_equals_plain_decoding(target, drafter):
    dec = Decoder(target, eagle=drafter)
    assert isinstance(dec.target, HFRunner)
    for prompt in ([3, 17, 41, 5, 60], [11, 2, 90, 45, 45, 7, 31, 8], [64]):
        ref = dec.generate(prompt, method="ar", max_new_tokens=24).tokens
        for gamma in (1, 3, 6):
            out = dec.generate(prompt, method="eagle", gamma=gamma, max_new_tokens=24)
            assert out.tokens == ref, (prompt, gamma)
            assert out.stats.method == "eagle" and out.stats.drafted > 0


@pytest.mark.parametrize("named", [None, [1, 3, 6]], ids=["default-layers", "named-layers"])
def test_the_drafter_reads_the_fused_hidden_states_of_its_layers_at_the_settled_positions(target, named):
    """Every real feature row the drafter is fed is the target's hidden states of the drafter's
    layers at that position (one plain forward over the final sequence), paired with the next token."""
    extra = {} if named is None else {"eagle_aux_hidden_state_layer_ids": named}
    config, state = eagle3_checkpoint(target, draft_ids_of(target.config.vocab_size, 48), seed=1, **extra)
    drafter = drafter_from_state(config, state).bind(target).eval()
    layers = (2, 4, 5) if named is None else tuple(named)
    assert drafter.feature_layers == layers
    fed = []
    real_step = drafter.step

    def spy(tokens, features, cache=None):
        if features.shape[-1] == 3 * target.config.hidden_size:
            fed.append((cache.length, tokens.tolist(), features.clone()))
        return real_step(tokens, features, cache)

    drafter.step = spy
    prompt = [3, 17, 41, 5, 60, 12]
    out = Decoder(target, eagle=drafter).generate(prompt, method="eagle", gamma=3, max_new_tokens=20)
    seq = prompt + out.tokens
    ref = fused(target, seq, layers)
    assert len(fed) > 2 and fed[0][0] == 0 and len(fed[0][1]) == len(prompt) - 1
    covered = 0
    for start, tokens, features in fed:  # each feeding continues where the real entries end
        assert start == covered and tokens == seq[start + 1 : start + 1 + len(tokens)]
        torch.testing.assert_close(features, ref[start : start + len(tokens)], atol=2e-4, rtol=2e-4)
        covered = start + len(tokens)
    assert covered >= len(seq) - 1 - 4  # all but the last step's positions (no drafting follows it)


def test_sampled_eagle3_follows_the_target_distribution():
    torch.set_num_threads(1)
    model = tiny_model("llama", vocab=VOCAB, seed=3, layers=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    config, state = eagle3_checkpoint(model, [0, 1, 2, 4], seed=2, scale=1.0,  # q is 0 on tokens 3 and 5
                                      eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    state["lm_head.weight"] *= 0.05  # a flat q: drafts are often accepted
    dec = Decoder(model, eagle=drafter_from_state(config, state).bind(model))
    trials, counts, accepted = 1200, {}, 0
    for i in range(trials):
        out = dec.generate(PROMPT, method="eagle", gamma=3, max_new_tokens=LENGTH, temperature=SAMPLING.temperature,
                           top_k=SAMPLING.top_k, seed=i)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        accepted += out.stats.accepted
    assert accepted > trials // 4, "drafts must be accepted for this test to mean anything"
    assert chi_square(counts, _exact(model), trials) > ALPHA


def bigram_target(seed: int):
    """A tiny random Llama whose layers add nothing (zero o_proj / down_proj): its next token is
    a function of the current token alone. Its embeddings share one constant coordinate (after
    the norm too) that its LM head ignores."""
    model = tiny_llama(seed=seed, layers=LAYERS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb.mul_(1.0 / emb.norm(dim=1, keepdim=True))
        emb[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
    return model


def copying_drafter(model, draft_ids: list[int]):
    """An EAGLE-3 checkpoint whose drafter predicts, at each entry, the normed embedding of the token
    the entry reads (times 4): attention keys and queries read only the constant coordinate, so with
    RoPE (frequencies 1 .. 31.6) each entry attends to itself; the values carry the token's normed
    embedding minus the normed feature, cancelling the residual of a fed-back prediction. Its LM
    head is the target's over ``draft_ids``: it drafts the bigram target's own choices."""
    e = model.config.hidden_size
    heads, beta, alpha = 4, 4.0, 2.0
    config, state = eagle3_checkpoint(model, draft_ids, heads=heads, kv_heads=heads, rope_theta=0.01)
    eye = torch.eye(e)
    state["fc.weight"].zero_()  # real entries add no residual
    for name in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        state[name] = torch.ones(e)
    qk = torch.zeros(e, 2 * e)
    qk[:, 0] = alpha
    state["midlayer.self_attn.q_proj.weight"], state["midlayer.self_attn.k_proj.weight"] = qk, qk.clone()
    state["midlayer.self_attn.v_proj.weight"] = torch.cat([beta * eye, -beta * eye], dim=1)
    state["midlayer.self_attn.o_proj.weight"] = eye
    state["midlayer.mlp.down_proj.weight"].zero_()
    state["lm_head.weight"] = model.lm_head.weight.detach()[torch.tensor(draft_ids)].clone()
    return config, state


def test_a_drafter_that_drafts_the_target_choices_has_its_chains_accepted():
    model = bigram_target(seed=0)
    vocab = model.config.vocab_size
    with torch.no_grad():
        choice = model(input_ids=torch.arange(vocab)[:, None]).logits[:, 0].argmax(-1).tolist()
    prompt = [5, 17, 33, 8]
    orbit, token = [], prompt[-1]
    while token not in orbit:  # the greedy output cycles through these
        orbit.append(token)
        token = choice[token]
    ids = sorted(set(orbit) | set(draft_ids_of(vocab, 40)))
    assert len(orbit) > 4 and len(ids) < vocab
    config, state = copying_drafter(model, ids)
    dec = Decoder(model, eagle=drafter_from_state(config, state).bind(model))
    ref = dec.generate(prompt, method="ar", max_new_tokens=40).tokens
    out = dec.generate(prompt, method="eagle", gamma=4, max_new_tokens=40)
    assert out.tokens == ref
    s = out.stats
    assert s.accepted >= 0.9 * s.drafted and s.drafted >= 24
    assert s.new_tokens / (s.target_forwards - 1) > 3  # tokens per verifying forward (the prefill aside)


# ---------------------------------------------------------------------- refusals
def test_the_fast_runner_refuses_an_eagle3_drafter_with_what_to_do(target, drafter):
    with pytest.raises(InvalidRequestError, match=r"does not return.*impl='hf'"):
        Decoder(target, eagle=drafter, impl="fast")
    fast = load_runner(target, impl="fast")
    with pytest.raises(InvalidRequestError, match=r"hidden_states \[2, 4, 5\].*impl='hf'"):
        generate_eagle(fast, drafter, torch.tensor([[3, 17, 41]]), sampling=SamplingConfig(),
                       generator=make_generator(0, fast.device), max_new_tokens=4)
    assert isinstance(Decoder(target, eagle=drafter, impl="hf").target, HFRunner)


def _refused(config, state, match, model=None):
    with pytest.raises(EagleError, match=match) as info:
        drafter = drafter_from_state(config, state, source="ckpt")
        if model is not None:
            drafter.bind(model)
    assert "Traceback" not in str(info.value)


def test_malformed_eagle3_checkpoints_are_refused_naming_the_problem(target):
    vocab, e = target.config.vocab_size, target.config.hidden_size
    ids = draft_ids_of(vocab, 48)
    config, state = eagle3_checkpoint(target, ids)
    # fc must fuse three target hidden states
    _refused(config, {**state, "fc.weight": torch.zeros(e, 2 * e)},
             r"ckpt \(EAGLE-3\): fc.weight has shape \(32, 64\), expected \(32, 96\): fc fuses 3 target hidden states")
    # a reduced draft vocabulary needs d2t
    _refused(config, {k: t for k, t in state.items() if k not in ("d2t", "t2d")}, r"no d2t tensor.*48 of the 96")
    # vocabularies that do not agree
    _refused({**config, "vocab_size": vocab + 4}, state, r"t2d must mark each of the vocab_size 100 target tokens")
    _refused({**config, "draft_vocab_size": 40}, state, r"d2t must hold 40 integer offsets")
    _refused(config, {**state, "lm_head.weight": torch.zeros(40, e)},
             r"lm_head.weight has shape \(40, 32\).*draft_vocab_size 48")
    bad = state["d2t"].clone()
    bad[-1] += 50
    _refused(config, {**state, "d2t": bad}, r"d2t maps draft tokens outside the target vocabulary of 96")
    dup = state["d2t"].clone()
    dup[1] = dup[0] - 1
    _refused(config, {**state, "d2t": dup}, r"d2t maps two draft tokens to one target token")
    _refused(config, {**state, "t2d": ~state["t2d"]}, r"t2d marks 48 target tokens, which are not the 48 that d2t")
    other = tiny_llama(seed=1, vocab=vocab + 4, layers=LAYERS)
    _refused(config, state, r"vocabulary \(96 tokens, t2d\) differs from the target's \(100 tokens\)", model=other)
    # layout, layers and widths
    _refused(config, {k: t for k, t in state.items() if k != "midlayer.hidden_norm.weight"},
             r"EAGLE-3's layout \(missing \['midlayer.hidden_norm.weight'\]")
    _refused({k: v for k, v in config.items() if k != "draft_vocab_size"}, state, r"no draft_vocab_size")
    _refused({**config, "eagle_aux_hidden_state_layer_ids": [2, 4]}, state, r"reads 3 target layers.*\[2, 4\]")
    _refused({**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, state,
             r"hidden_states \[2, 4, 8\]; a 8-layer target has the inputs of layers 0 .. 7", model=target)
    _refused(config, state, r"default layers \(2, L // 2, L - 3\) need a target of at least 7 layers, this one has 4",
             model=tiny_llama(seed=1, layers=4))
    _refused({**config, "target_hidden_size": 16}, {**state, "fc.weight": torch.zeros(e, 48)},
             r"target hidden states of width 16 .* the target's are 32 wide", model=target)
    _refused({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, state,
             r"^ckpt \(EAGLE-3\): rope_scaling .* not supported")

