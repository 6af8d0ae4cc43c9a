"""MedusaHeads: initialisation, the artifact format, binding to a base model, Decoder integration."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specops.decoder import Decoder, MedusaHeads
from specops.spec.errors import InvalidRequestError, MissingComponentError
from specops.models.medusa_heads import CONFIG_NAME, WEIGHTS_NAME, MedusaError, inference_dtype, model_fingerprint
from specops.kernels import cpu_linear
from tests.decoder.medusa_models import one_thread, tiny_model  # noqa: F401 (fixture)


def perturb(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return heads


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_untrained_heads_equal_the_lm_head(arch):
    model = tiny_model(arch)
    heads = MedusaHeads.from_model(model, num_heads=3, num_layers=2)
    hidden = torch.randn(2, 5, 32)  # [B, T, E]
    logits = heads(hidden)  # [K, B, T, V]
    assert logits.shape == (3, 2, 5, 64)
    want = model.get_output_embeddings()(hidden)  # [B, T, V]
    for k in range(3):
        torch.testing.assert_close(logits[k], want)
    assert heads(hidden, num_heads=2).shape[0] == 2
    # copies, not views: training a head must not touch the base model
    assert heads.lm_heads[0].weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()


def test_save_load_round_trip(tmp_path):
    model = tiny_model("llama")
    heads = perturb(MedusaHeads.from_model(model, num_heads=2))
    heads.with_accuracy([[0.5, 0.2], [0.3, 0.1]])
    heads.save_pretrained(tmp_path / "h")
    assert {p.name for p in (tmp_path / "h").iterdir()} == {CONFIG_NAME, WEIGHTS_NAME}
    config = json.loads((tmp_path / "h" / CONFIG_NAME).read_text())
    assert config["base_model_hash"] == model_fingerprint(model)
    assert config["num_heads"] == 2 and config["head_topk_accuracy"] == [[0.5, 0.2], [0.3, 0.1]]
    fast = MedusaHeads.from_pretrained(tmp_path / "h", base=model)
    assert fast.blocks[0][0].linear.weight.dtype == inference_dtype("cpu")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.float32)
    hidden = torch.randn(4, 32)
    rounded = {k: v.half().float() for k, v in heads.state_dict().items()}  # stored as fp16
    heads.load_state_dict(rounded)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)
    assert loaded.config == heads.config


def test_shared_lm_head_artifact_holds_only_blocks(tmp_path):
    model = tiny_model("gpt2")
    heads = perturb(MedusaHeads.from_model(model, num_heads=3, shared_lm_head=True))
    assert all(not k.startswith("lm_heads") for k in heads.state_dict())
    heads.save_pretrained(tmp_path / "h")
    unbound = MedusaHeads.from_pretrained(tmp_path / "h")
    with pytest.raises(MedusaError, match="bind"):
        unbound(torch.randn(32))
    bound = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.float32)
    hidden = torch.randn(32)
    want = torch.stack([model.get_output_embeddings()(heads.blocks[k](hidden)) for k in range(3)])
    torch.testing.assert_close(bound(hidden), want, atol=1e-2, rtol=1e-2)  # fp16 storage
    fast = MedusaHeads.from_pretrained(tmp_path / "h", base=model)  # its own LM-head copy in the heads' dtype
    assert fast(hidden).dtype == inference_dtype("cpu")
    torch.testing.assert_close(fast(hidden).float(), want, atol=0.1, rtol=0.05)


def test_bad_artifacts_and_mismatched_bases(tmp_path, caplog):
    model = tiny_model("llama")
    heads = MedusaHeads.from_model(model, num_heads=2)
    with pytest.raises(MedusaError, match="not a Medusa heads directory"):
        MedusaHeads.from_pretrained(tmp_path / "missing")
    heads.save_pretrained(tmp_path / "h")
    with pytest.raises(MedusaError, match="hidden=32, vocab=64.*hidden=32, vocab=80"):
        heads.bind(tiny_model("llama", vocab=80))
    with caplog.at_level(logging.WARNING, logger="specops.models.medusa_heads"):
        MedusaHeads.from_pretrained(tmp_path / "h", base=tiny_model("llama", seed=9))
    assert "not this one" in caplog.text
    config = json.loads((tmp_path / "h" / CONFIG_NAME).read_text())
    (tmp_path / "h" / CONFIG_NAME).write_text(json.dumps({**config, "bogus": 1}))
    with pytest.raises(MedusaError, match="unknown fields"):
        MedusaHeads.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / CONFIG_NAME).write_text(json.dumps({**config, "num_heads": 3}))
    with pytest.raises(MedusaError, match="missing"):
        MedusaHeads.from_pretrained(tmp_path / "h")
    with pytest.raises(MedusaError, match="num_heads must be a positive int"):
        MedusaHeads.from_model(model, num_heads=0)
    with pytest.raises(MedusaError, match="width 16"):
        heads(torch.randn(16))
    with pytest.raises(MedusaError, match="heads=3 out of range"):
        heads(torch.randn(32), num_heads=3)


def test_decoder_medusa_method(tmp_path, one_thread):
    model = tiny_model("llama", seed=4)
    heads = perturb(MedusaHeads.from_model(model, num_heads=3))
    dec = Decoder(model, medusa=heads)
    prompt = [5, 9, 2, 7]
    ar = dec.generate(prompt, method="ar", max_new_tokens=20)
    for tree in ("chain", "large", [(0,), (1,), (0, 0)], None):
        out = dec.generate(prompt, method="medusa", max_new_tokens=20, heads=2, tree=tree)
        assert out.tokens == ar.tokens
        assert out.stats.method == "medusa" and out.stats.heads == 2
    record = out.stats.to_record("code")
    assert record.method == "medusa" and len(record.head_predictions) == 2
    sampled = dec.generate(prompt, method="medusa", max_new_tokens=8, temperature=1.0, seed=3)
    again = dec.generate(prompt, method="medusa", max_new_tokens=8, temperature=1.0, seed=3)
    assert sampled.tokens == again.tokens  # seeded sampling is reproducible
    with pytest.raises(InvalidRequestError, match="heads must be in 1..3"):
        dec.generate(prompt, method="medusa", heads=4)
    with pytest.raises(MissingComponentError):
        Decoder(model).generate(prompt, method="medusa")
    # from_pretrained with a heads folder
    model.save_pretrained(tmp_path / "target")
    heads.save_pretrained(tmp_path / "heads")
    loaded = Decoder.from_pretrained(tmp_path / "target", medusa=tmp_path / "heads")
    assert loaded.generate(prompt, method="medusa", max_new_tokens=20).tokens == ar.tokens


def test_inference_on_cpu_runs_the_heads_on_the_c_kernel_with_the_base_fp32_lm_head(tmp_path):
    """Under inference mode, fp32 hidden states on CPU: the blocks and the shared LM head run
    in fp32 math on `cpu_linear` (torch's bf16 path woke its OpenMP team every step), from bf16
    weight copies where the kernel reads them (a proposal reads half the bytes; proposals never
    change the output); the logits equal the fp32 torch path up to that rounding, whatever dtype
    the heads are stored in."""
    from specops.kernels import cpu_linear

    assert cpu_linear.available(), cpu_linear.unavailable_reason()
    tol = dict(atol=0.02, rtol=0.02) if cpu_linear.bf16_weights() else dict(atol=1e-5, rtol=1e-5)
    model = tiny_model("llama")
    heads = perturb(MedusaHeads.from_model(model, num_heads=3, shared_lm_head=True))
    heads.save_pretrained(tmp_path / "h", dtype=torch.float32)
    fp32 = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.float32)
    bf16 = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.bfloat16)
    for hidden in (torch.randn(32), torch.randn(2, 32)):
        want = fp32(hidden)  # grad mode: the torch path
        with torch.inference_mode():
            got = fp32(hidden)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, **tol)
            torch.testing.assert_close(bf16(hidden), want, atol=0.05, rtol=0.05)  # bf16-rounded block weights
            torch.testing.assert_close(fp32(hidden, num_heads=2), want[:2], **tol)
    with torch.no_grad():  # weights changed after a first call: the kernel's copies follow
        fp32.blocks[0][0].linear.weight.add_(0.5)
    want = fp32(torch.ones(32))
    with torch.inference_mode():
        torch.testing.assert_close(fp32(torch.ones(32)), want, **tol)


def test_root_input_heads_read_the_root_token_through_the_base_embedding(tmp_path):
    """root_input heads: input h + R e(root), R zero at first (then they equal plain heads with
    the same blocks), roots required and shape-checked, the C kernel path equal to torch's, and
    the artifact round trip keeps R and the flag."""
    model = tiny_model("llama")
    plain = perturb(MedusaHeads.from_model(model, num_heads=2, num_layers=2, shared_lm_head=True))
    heads = MedusaHeads.from_model(model, num_heads=2, num_layers=2, shared_lm_head=True, root_input=True)
    heads.load_state_dict(plain.state_dict(), strict=False)
    hidden, roots = torch.randn(3, 32), torch.tensor([1, 7, 63])
    torch.testing.assert_close(heads(hidden, roots=roots), plain(hidden), rtol=0, atol=0)
    with torch.no_grad():
        heads.root_proj.weight.normal_(0, 0.5)
    logits = heads(hidden, roots=roots)
    assert not torch.allclose(logits, plain(hidden))
    # the root matters, per row: changing one root changes that row only
    other = heads(hidden, roots=torch.tensor([1, 8, 63]))
    assert torch.equal(other[:, 0], logits[:, 0]) and not torch.allclose(other[:, 1], logits[:, 1])
    for bad in (None, torch.tensor([1, 2]), torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(MedusaError, match="roots"):
            heads(hidden, roots=bad)
    with pytest.raises(MedusaError, match="do not read the root"):
        plain(hidden, roots=roots)
    heads.save_pretrained(tmp_path / "h", dtype=torch.float32)
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.float32)
    assert loaded.config.root_input and loaded.config == heads.config
    torch.testing.assert_close(loaded(hidden, roots=roots), logits, rtol=0, atol=0)
    from specops.kernels import cpu_linear

    tol = dict(atol=0.05, rtol=0.05) if cpu_linear.bf16_weights() else dict(atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        assert loaded._kernel_ready()
        torch.testing.assert_close(loaded(hidden, roots=roots), logits, **tol)
        torch.testing.assert_close(loaded(hidden[0], 1, roots=roots[0]), logits[:1, 0], **tol)
    with pytest.raises(MedusaError, match="bind"):
        MedusaHeads.from_pretrained(tmp_path / "h", dtype=torch.float32)(hidden, roots=roots)
    # own LM heads: untrained, root input or not, each head is the base model's LM head
    own = MedusaHeads.from_model(model, num_heads=2, root_input=True)
    torch.testing.assert_close(own(hidden, roots=roots)[1], model.get_output_embeddings()(hidden))


def test_decoder_medusa_with_root_input_heads_is_exact_and_feeds_each_step_its_root(one_thread):
    model = tiny_model("llama", layers=2)
    heads = perturb(MedusaHeads.from_model(model, num_heads=3, shared_lm_head=True, root_input=True), seed=3)
    seen = []
    candidates = heads.candidates  # what a proposal calls, on the fused kernel path or not

    def spy(hidden, num_heads, top_k, roots=None):
        seen.append(roots.tolist())
        return candidates(hidden, num_heads, top_k, roots=roots)

    heads.candidates = spy
    prompt = list(range(5, 17))
    ar = Decoder(model).generate(prompt, method="ar", max_new_tokens=30)
    out = Decoder(model, medusa=heads).generate(prompt, method="medusa", max_new_tokens=30, tree="small")
    assert out.tokens == ar.tokens
    # each step's root is the pending token: the prompt's last for the first step, then the last one emitted
    assert seen[0] == [prompt[-1]] and all(len(r) == 1 and r[0] in [prompt[-1], *ar.tokens] for r in seen)


@pytest.mark.parametrize("shared", [True, False])
def test_a_shortlist_ranks_only_its_tokens_and_survives_the_artifact(tmp_path, shared):
    """candidates(): each head's top-k token ids; with a shortlist, the top-k among the shortlisted
    tokens only (the kernel path reads only their LM-head rows), equal to masking the full
    logits; saved as integer ids (not rounded through fp16) and loaded back."""
    model = tiny_model("llama")
    heads = perturb(MedusaHeads.from_model(model, num_heads=2, shared_lm_head=shared))
    hidden = torch.randn(3, 32)
    with torch.inference_mode():  # the path candidates() takes (the C kernel for shared heads)
        full = heads(hidden).clone()  # [K, 3, V]
    torch.testing.assert_close(heads.candidates(hidden, 2, 4), torch.topk(full, 4, dim=-1).indices)
    short = torch.tensor([60, 3, 17, 41, 8, 29, 50, 1, 33, 12])
    heads.set_shortlist(short)
    assert heads.config.shortlist_size == 10
    masked = torch.full_like(full, float("-inf"))
    masked[..., short] = full[..., short]
    want = torch.topk(masked, 4, dim=-1).indices
    got = heads.candidates(hidden, 2, 4)
    assert got.shape == (2, 3, 4) and torch.equal(got, want)
    assert torch.equal(heads.candidates(hidden, 2, 11), torch.topk(full, 11, dim=-1).indices)  # k > F: all
    heads.save_pretrained(tmp_path / "h")  # fp16 weights; ids stay exact
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", base=model, dtype=torch.float32)
    assert torch.equal(loaded.shortlist, short) and loaded.config.shortlist_size == 10
    assert set(loaded.candidates(hidden, 2, 4).flatten().tolist()) <= set(short.tolist())
    for bad in ([1, 1], [64], [-1], []):
        with pytest.raises(MedusaError, match="shortlist"):
            heads.set_shortlist(torch.tensor(bad, dtype=torch.long))
    heads.set_shortlist(None)
    assert heads.config.shortlist_size == 0 and "shortlist" not in heads.state_dict()
    assert torch.equal(heads.candidates(hidden, 2, 4), torch.topk(full, 4, dim=-1).indices)


@pytest.mark.skipif(not cpu_linear.available(), reason="the C kernel did not build here")
def test_one_kernel_call_proposes_what_the_per_call_kernel_ranks(monkeypatch):
    """`cpu_linear.medusa_candidates` (root projection, every head's blocks, the LM head over
    the shortlist or the vocabulary and the top-k in one C call) returns the ids the per-call
    kernel path's logits rank first, for root-input heads, 1 and 3 rows, 1-3 heads."""
    model = tiny_model("llama")
    heads = perturb(MedusaHeads.from_model(model, num_heads=3, shared_lm_head=True, root_input=True), seed=5)
    calls = []
    fused = cpu_linear.medusa_candidates
    monkeypatch.setattr(cpu_linear, "medusa_candidates", lambda *a, **k: calls.append(1) or fused(*a, **k))
    gen = torch.Generator().manual_seed(0)
    for short in (None, torch.tensor([60, 3, 17, 41, 8, 29, 50, 1, 33, 12])):
        heads.set_shortlist(short)
        for rows in (1, 3):
            hidden = torch.randn(rows, 32, generator=gen) * 2
            roots = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)
            with torch.inference_mode():
                assert heads._kernel_ready()
                logits = heads._kernel_logits(hidden, 3, roots)  # [K, R, V], the per-call kernel path
            if short is not None:
                logits = logits[..., short]
            for k in (1, 2, 3):
                want = torch.topk(logits[:k], 4, dim=-1).indices
                want = want if short is None else short[want]
                n = len(calls)
                got = heads.candidates(hidden, k, 4, roots=roots)
                assert len(calls) == n + 1 and torch.equal(got, want), (short is None, rows, k)
    with pytest.raises(ValueError, match="root id"):
        heads.candidates(torch.randn(1, 32), 2, 4, roots=torch.tensor([model.config.vocab_size]))


def test_medusa_decoding_with_a_shortlist_is_exact_on_the_bundled_models():
    """The bundled heads with a shortlist: outputs equal plain decoding (proposals only change)."""
    from specops.assets import MEDUSA_DIR, TARGET_DIR

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    heads = MedusaHeads.from_pretrained(MEDUSA_DIR, base=target, dtype=torch.float32)
    heads.set_shortlist(torch.arange(5, 1005))
    dec = Decoder(target, medusa=heads)
    prompt = list(range(40, 72))
    ar = dec.generate(prompt, method="ar", max_new_tokens=40)
    out = dec.generate(prompt, method="medusa", max_new_tokens=40, tree="small")
    assert out.tokens == ar.tokens
