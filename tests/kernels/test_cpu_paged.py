"""The CPU paged-attention kernel against SDPA over gathered keys/values, and the paged
forward with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specops.kernels import cpu_paged
from tests.services import require_binary


@pytest.fixture(scope="module", autouse=True)
def kernel():
    # built from source with the system C compiler: without one the runtime keeps SDPA
    # (test_no_compiler_means_sdpa_not_an_error); with one, a failed build is a bug
    require_binary("cc", "gcc")
    assert cpu_paged.available(), cpu_paged.unavailable_reason()


def _reference(q_all, k_store, v_store, q_index, visible, kv_slots, scale):
    """SDPA over gathered keys with the equivalent bool mask; [N, Hq, D] rows at q_index."""
    g, tq = q_index.shape
    lk = kv_slots.shape[1]
    n, hq, d = q_all.shape
    hkv = k_store.shape[1]
    k = k_store[kv_slots].transpose(1, 2)  # [G, Hkv, Lk, D]
    v = v_store[kv_slots].transpose(1, 2)
    q = q_all[q_index].transpose(1, 2)  # [G, Hq, Tq, D]
    mask = torch.arange(lk)[None, None, :] < visible[:, :, None]  # [G, Tq, Lk]
    mask[:, :, 0] |= visible == 0  # padded queries: any finite row
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv)
    out = torch.full((n, hq, d), float("nan"))
    o = o.transpose(1, 2)  # [G, Tq, Hq, D]
    for gi in range(g):
        for t in range(tq):
            if visible[gi, t] > 0:
                out[q_index[gi, t]] = o[gi, t]
    return out


# (32, 1, 16): more query heads per kv head than the multi-query path has lanes (per-query path)
@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 32), (4, 4, 16), (12, 2, 64), (2, 1, 8), (4, 2, 128), (32, 1, 16)])
@pytest.mark.parametrize("tq", [1, 3, 8, 16])
def test_matches_sdpa_on_random_paged_batches(hq, hkv, d, tq):
    gen = torch.Generator().manual_seed(hq * 100 + tq * 10 + d)
    slots, g = 512, 5
    k_store = torch.randn(slots, hkv, d, generator=gen)
    v_store = torch.randn(slots, hkv, d, generator=gen)
    prefixes = torch.randint(0, 60, (g,), generator=gen).tolist()
    lens = [int(x) for x in torch.randint(1, tq + 1, (g,), generator=gen)]
    lk = max(p + t for p, t in zip(prefixes, lens))
    perm = torch.randperm(slots, generator=gen)
    kv_slots = torch.zeros(g, lk, dtype=torch.long)
    q_rows, visible, n = [], [], 0
    for i, (p, t) in enumerate(zip(prefixes, lens)):
        kv_slots[i, : p + t] = perm[i * 100 : i * 100 + p + t]  # scattered slots
        q_rows.append(list(range(n, n + t)) + [0] * (tq - t))
        visible.append([p + j + 1 if j < t else 0 for j in range(tq)])
        n += t
    q_index, visible = torch.tensor(q_rows), torch.tensor(visible)
    # q rows strided as in the fused qkv projection: [N, Hq + 2 Hkv, D] sliced to the first Hq heads
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=gen)
    q_all = qkv[:, :hq]
    scale = d ** -0.5
    out = torch.full((n, hq, d), float("nan"))
    cpu_paged.paged_attention(q_all, k_store, v_store, q_index, visible, kv_slots, out, scale)
    ref = _reference(q_all, k_store, v_store, q_index, visible, kv_slots, scale)
    assert not torch.isnan(out).any(), "every real query row is written"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_support():
    q = torch.randn(2, 3, 8)
    k = torch.randn(16, 2, 8)  # 3 query heads over 2 kv heads: not a GQA grouping
    idx, vis, slots = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="refused"):
        cpu_paged.paged_attention(q, k, k, idx, vis, slots, torch.empty(2, 3, 8), 1.0)
    with pytest.raises(ValueError, match="fp32"):
        cpu_paged.paged_attention(q.double(), k, k, idx, vis, slots, torch.empty(2, 3, 8), 1.0)


def test_paged_forward_with_the_kernel_equals_the_sdpa_path():
    """Same engine steps (prefill, plain decoding of several sequences) with the kernel and
    without: logits equal up to rounding, greedy tokens identical."""
    from specops.decoder import Decoder
    from specops.engine.engine import Engine
    from specops.engine.sequence import SamplingParams, SpecSettings

    dec = Decoder.from_pretrained("bundled")
    prompts = [dec.tokenizer.encode(t) for t in ("def add(a, b):\n", "The river", "import os\nimport sys\n",
                                                   "x = [i * i for i in range(")]
    outs = {}
    for use in (True, False):
        eng = Engine(dec, max_batch=4, kv_cache_mb=8, calibrate=False)
        eng.target.model.cpu_kernel = use
        eng.target.model.c_layers = False  # the per-layer path (the C layer stack has its own tests)
        for i, p in enumerate(prompts):
            method = "ngram" if i % 2 else "ar"  # chain drafts verify through the kernel too
            eng.add(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True), SpecSettings(method=method, gamma=4))
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs[use] = got
    assert outs[True] == outs[False]


def test_no_compiler_means_sdpa_not_an_error(monkeypatch, tmp_path):
    """A machine without a C compiler (or a failing build) gets the SDPA path and one log
    line; the paged model then gathers as before."""
    import importlib

    fresh = importlib.reload(cpu_paged)  # module state: not tried yet
    try:
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("SPECOPS_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
        assert not fresh.available()
        assert "no-such-cc" in (fresh.unavailable_reason() or "")
        from specops.decoder import Decoder
        from specops.models.paged_llama import PagedLlama

        model = PagedLlama(Decoder.from_pretrained("bundled").target, num_blocks=4, block_size=16)
        assert model.cpu_kernel is False and not model.kernel_group(1, tree=False)
    finally:
        monkeypatch.undo()
        importlib.reload(cpu_paged)
        assert cpu_paged.available()


def test_peaked_scores_match_sdpa():
    """Large scores (a peaked softmax: most exp terms underflow, many below exp(-87)) and a long
    prefix, through both the one-query and the multi-query path: no further from the float64
    result than SDPA in float32 (whose own error here is the rounding of scores in the hundreds)."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d, slots, g = 8, 4, 32, 2048, 3
    k_store, v_store = 4 * torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    lk = 700
    kv_slots = torch.stack([torch.randperm(slots, generator=gen)[:lk] for _ in range(g)])
    for tq in (1, 5):
        n = g * tq
        q_index = torch.arange(n).view(g, tq)
        visible = torch.tensor([[lk - tq + j + 1 for j in range(tq)] for _ in range(g)])
        q = 4 * torch.randn(n, hq, d, generator=gen)
        out = torch.full((n, hq, d), float("nan"))
        cpu_paged.paged_attention(q, k_store, v_store, q_index, visible, kv_slots, out, 1.0)
        ref = _reference(q, k_store, v_store, q_index, visible, kv_slots, 1.0)
        exact = _reference(q.double(), k_store.double(), v_store.double(), q_index, visible, kv_slots, 1.0)
        assert (out - exact).abs().max() <= 2 * (ref - exact).abs().max() + 1e-6


@pytest.mark.parametrize("tq", [1, 5])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_any_thread_count_writes_the_same_rows(threads, tq):
    """Work split across threads by key count: the same output as one thread, bit for bit."""
    gen = torch.Generator().manual_seed(threads)
    hq, hkv, d, slots, g, lk = 8, 4, 32, 4096, 16, 300
    k_store, v_store = torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    kv_slots = torch.stack([torch.randperm(slots, generator=gen)[:lk] for _ in range(g)])
    visible = torch.randint(tq, lk + 1, (g, 1), generator=gen) - torch.arange(tq - 1, -1, -1)  # a causal block
    q_index = torch.arange(g * tq).view(g, tq)
    q = torch.randn(g * tq, hq, d, generator=gen)
    one, many = torch.empty(g * tq, hq, d), torch.empty(g * tq, hq, d)
    cpu_paged.paged_attention(q, k_store, v_store, q_index, visible, kv_slots, one, 0.2, threads=1)
    cpu_paged.paged_attention(q, k_store, v_store, q_index, visible, kv_slots, many, 0.2, threads=threads)
    assert torch.equal(one, many)


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """The kernel's library must not switch the process to flush-to-zero (what linking with
    -ffast-math does): subnormals stay representable for everyone else, torch included."""
    import subprocess
    import sys

    code = ("from specops.kernels import cpu_paged\n"
            "assert cpu_paged.available(), cpu_paged.unavailable_reason()\n"
            "import torch\n"
            "tiny = float.fromhex('0x0.0000000000001p-1022')\n"
            "one = float(len('x'))\n"
            "assert tiny * one > 0.0, 'flush-to-zero is on'\n"
            "t = torch.tensor([1e-40], dtype=torch.float32)\n"
            "assert (t * 1.0).item() > 0.0, 'float32 subnormals flushed'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
