"""The CPU linear kernel (`specops.kernels.cpu_linear`): right, and the same bits for any
number of rows or threads (what keeps speculation's verify forwards equal to plain steps)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from specops.models.packed_linear import PackedLinear
from specops.kernels import cpu_linear
from tests.kernels.trees import mask_from_parents



def test_the_kernel_is_built_here():
    """CI machines have a C compiler: every test below runs (a missing build fails, never skips)."""
    assert cpu_linear.available(), cpu_linear.unavailable_reason()


@pytest.mark.parametrize("k,n", [(256, 512), (688, 256), (7, 5), (24, 130), (33, 1000)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matches_addmm(k, n, rows):
    gen = torch.Generator().manual_seed(k * n + rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b, r = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    want = torch.addmm(b.double(), x.double(), w.double().t()).float()
    torch.testing.assert_close(cpu_linear.linear(x, w, b), want, atol=2e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(x, w, b, add=r), want + r, atol=2e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(x, w), want - b, atol=2e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_every_row_is_the_same_bits_for_any_row_count_and_thread_count(threads):
    gen = torch.Generator().manual_seed(threads)
    # a tail after the 16-wide blocks, and an 8-wide one; a partial last chunk; an odd weight
    # row count (a lone last row); 17 rows: blocks of 8 (sums reduced 16 at a time) and 1
    k, n, rows = 264, 1101, 17
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    one_thread = cpu_linear.linear(x, w, b, threads=1)
    assert torch.equal(cpu_linear.linear(x, w, b, threads=threads), one_thread)
    for t in range(rows):  # a row alone (sums reduced one by one), and in blocks of 2..8 at other offsets
        assert torch.equal(cpu_linear.linear(x[t : t + 1].contiguous(), w, b, threads=threads)[0], one_thread[t])
        assert torch.equal(cpu_linear.linear(x[t:].contiguous(), w, b, threads=threads), one_thread[t:])


def test_writes_into_the_residual_it_adds():
    x, w = torch.randn(2, 40), torch.randn(300, 40)
    residual = torch.randn(2, 300)
    want = residual + cpu_linear.linear(x, w)
    cpu_linear.linear(x, w, add=residual, out=residual, threads=2)
    torch.testing.assert_close(residual, want, atol=1e-6, rtol=0)


def test_refuses_bad_inputs():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="features"):
        cpu_linear.linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="fp32"):
        cpu_linear.linear(x.double(), w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear(torch.randn(8, 2).t(), w)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="add"):
        cpu_linear.linear(x, w, add=torch.randn(3, 4))


def test_callers_on_several_threads_at_once_get_their_own_results():
    """One pool: a second caller while it is busy runs on its own thread, never mixes jobs."""
    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(700, 128, generator=gen) for _ in range(4)]
    xs = [torch.randn(3, 128, generator=gen) for _ in range(4)]
    want = [cpu_linear.linear(x, w, threads=1) for x, w in zip(xs, ws)]
    errors: list[str] = []

    def hammer(i: int) -> None:
        for _ in range(300):
            if not torch.equal(cpu_linear.linear(xs[i], ws[i], threads=2), want[i]):
                errors.append(f"caller {i}")
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors


POOL_PROBE = """
import json, torch
from specops.kernels import cpu_linear
gen = torch.Generator().manual_seed(3)
x, w = torch.randn(4, 256, generator=gen), torch.randn(4096, 256, generator=gen)
want = cpu_linear.linear(x, w, threads=1)
used = {}
for threads, rows, calls in ((4, 4096, 100), (2, 4096, 400), (4, 256, 200), (3, 4096, 400)):
    seen = used.setdefault(f"{threads}/{rows}", [])
    for _ in range(calls):
        assert torch.equal(cpu_linear.linear(x, w[:rows], threads=threads), want[:, :rows]), (threads, rows)
        seen.append(cpu_linear.pool_last_threads())
    seen[:] = sorted(set(seen))
print(json.dumps({"workers": cpu_linear.pool_workers(), "used": used}))
"""


def test_a_job_runs_on_no_more_threads_than_it_was_given_once_more_workers_exist():
    """After a 4-thread job started 3 workers, a 2-thread job runs on the caller and one of
    them, a 3-thread job on two, and a job of 256 outputs (MIN_ROWS_PER_THREAD 128) on two,
    whatever the ``threads`` asked: the other workers sit the job out. Same bits throughout.
    A fresh process: the pool is the process's."""
    proc = subprocess.run([sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    used = report["used"]
    assert report["workers"] == 3, report
    assert max(used["4/4096"]) >= 2, report  # the pool does split a large job
    assert max(used["2/4096"]) <= 2 and max(used["3/4096"]) <= 3, report
    assert max(used["4/256"]) <= 2, report


def test_a_forked_child_still_runs_the_kernel():
    """The pool's threads do not survive fork(); the child must not wait for them."""
    code = ("import os, torch\n"
            "from specops.kernels import cpu_linear\n"
            "x, w = torch.randn(2, 64), torch.randn(512, 64)\n"
            "want = cpu_linear.linear(x, w, threads=2)\n"  # starts the pool in the parent
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    ok = torch.equal(cpu_linear.linear(x, w, threads=2), want)\n"
            "    os._exit(0 if ok else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_packed_linear_uses_it_for_few_rows_and_onednn_above():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = PackedLinear(w, b, onednn=False)
    # no oneDNN: MKL's input-major copy serves the rows above the kernel's
    assert layer.kernel_rows == cpu_linear.MAX_ROWS and layer.weight_t is not None
    for rows in (1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 5):
        x, r = torch.randn(rows, 64, generator=gen), torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(layer(x), torch.addmm(b, x, w.t()), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(layer.add_to(r, x), r + torch.addmm(b, x, w.t()), atol=1e-4, rtol=1e-5)
    plain = PackedLinear(w, b, onednn=False, cpu_kernel=False)
    assert plain.kernel_rows == 0 and plain.weight is None


@pytest.mark.parametrize("n", [1, 31, 32, 33, 96, 100])
def test_the_panel_layout_round_trips_and_puts_each_inputs_weights_side_by_side(n):
    """`pack` keeps the shape and the elements; a whole panel's row k is the 32 outputs'
    weights at input k, and a last narrower panel holds the remaining rows the same way."""
    w = torch.arange(n * 5, dtype=torch.float32).view(n, 5)
    packed = cpu_linear.pack(w)
    assert packed.shape == w.shape and packed.is_contiguous()
    assert torch.equal(cpu_linear.unpack(packed), w)
    assert torch.equal(packed.sum(), w.sum()) and not (n > 1 and torch.equal(packed, w))
    flat, full = packed.view(-1), n - n % cpu_linear.PANEL
    if full:
        assert torch.equal(flat[: cpu_linear.PANEL], w[: cpu_linear.PANEL, 0])  # panel 0, input 0
    if n > full:
        assert torch.equal(flat[full * 5: full * 5 + n - full], w[full:, 0])  # the last panel, input 0


def test_a_verify_forward_gives_the_logits_of_one_position_forwards():
    """With the kernels (linear layers and dense attention), the fast runner's 5-position
    forward after a prefix equals five 1-position forwards bit for bit, on 1 and 2 threads:
    a chain verification can never disagree with plain decoding over rounding."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    prompt = torch.arange(3, 40).view(1, -1)
    new = torch.tensor([[7, 8, 9, 10, 11]])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runner.reset(1)
            runner.forward(prompt)
            wide = runner.forward(new).logits[0]  # [5, V]
            runner.reset(1)
            runner.forward(prompt)
            narrow = torch.cat([runner.forward(new[:, i : i + 1]).logits[0] for i in range(5)])  # [5, V]
            assert torch.equal(wide, narrow), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_and_swiglu_inputs_match_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    k, n = 136, 300
    x, w, g = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.rand(k, generator=gen)
    want = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (k,), g, 1e-5), w)
    torch.testing.assert_close(cpu_linear.linear(x, w, norm=g, eps=1e-5), want, atol=1e-4, rtol=1e-5)
    gate_up, r = torch.randn(rows, 2 * k, generator=gen), torch.randn(rows, n, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    want = r + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w)
    torch.testing.assert_close(cpu_linear.linear(gate_up, w, add=r, swiglu=True), want, atol=1e-4, rtol=1e-5)
    one = cpu_linear.linear(x[:1].contiguous(), w, norm=g, eps=1e-5)  # the first row alone: the same bits
    assert torch.equal(one[0], cpu_linear.linear(x, w, norm=g, eps=1e-5)[0])
    with pytest.raises(ValueError, match="exclusive"):
        cpu_linear.linear(gate_up, w, norm=g, swiglu=True)
    with pytest.raises(ValueError, match="norm"):
        cpu_linear.linear(x, w, norm=torch.rand(k + 1))


def test_packed_linear_fused_inputs_equal_the_unfused_path_above_the_kernel_rows():
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(80, 48, generator=gen), torch.rand(48, generator=gen)
    layer = PackedLinear(w, None, onednn=False)
    for rows in (2, cpu_linear.MAX_ROWS + 3):  # the kernel, then F.rms_norm / silu + mm
        x = torch.randn(rows, 48, generator=gen)
        torch.testing.assert_close(layer.normed(x, g, 1e-6), layer(torch.nn.functional.rms_norm(x, (48,), g, 1e-6)),
                                   atol=1e-4, rtol=1e-5)
        gate_up, r = torch.randn(rows, 96, generator=gen), torch.randn(rows, 80, generator=gen)
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(layer.swiglu_add_to(r, gate_up), layer.add_to(r, torch.nn.functional.silu(gate) * up),
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,t", [(8, 4, 1), (8, 4, 5), (4, 4, 3), (6, 2, 1)])
def test_causal_attention_matches_sdpa(hq, hkv, t):
    gen = torch.Generator().manual_seed(hq * 10 + t)
    b, d, length, s = 2, 16, 37, 64
    qkv = torch.randn(b, t, hq + 2 * hkv, d, generator=gen)  # q is a strided slice of it, as in the runner
    q = qkv[:, :, :hq]
    cache = torch.randn(2, b, hkv, s, d, generator=gen)
    k, v = cache[0].narrow(2, 0, length), cache[1].narrow(2, 0, length)
    got = cpu_linear.causal_attention(q, k, v, 0.3)
    mask = torch.ones(t, length, dtype=torch.bool).tril(diagonal=length - t)  # query i sees L - T + i + 1 keys
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=0.3,
                                                            enable_gqa=True)  # [B, Hq, T, D]
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(b * t, hq * d), atol=1e-5, rtol=1e-5)
    last = cpu_linear.causal_attention(q[:, -1:], k, v, 0.3)  # the last query alone: the same bits
    assert torch.equal(last.view(b, hq * d), got.view(b, t, hq * d)[:, -1])
    with pytest.raises(ValueError, match="layout"):
        cpu_linear.causal_attention(q, k, v.contiguous().transpose(2, 3).contiguous().transpose(2, 3), 0.3)


def test_runner_uses_the_dense_kernel_for_steps_and_chains_not_trees():
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    assert runner.cpu_attention
    runner.reset(1)
    runner.forward(torch.arange(3, 20).view(1, -1))
    assert runner._attention_plan(1, None)[0] == "dense"
    assert runner._attention_plan(5, None)[0] == "dense"
    assert runner._attention_plan(3, torch.ones(3, 3, dtype=torch.bool).tril())[0] != "dense"
    runner.reset(1)
    assert runner._attention_plan(8, None)[0] == "causal"  # a prefill on an empty cache keeps SDPA


def test_rope_cache_attention_equals_the_torch_rotary_then_the_attention_kernel():
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = runner.n_heads, runner.n_kv_heads, runner.head_dim
    b, t, start, slots = 1, 3, 11, 32
    qkv = torch.randn(b, t, hq + 2 * hkv, d, generator=gen)
    cache = torch.randn(2, b, hkv, slots, d, generator=gen)
    cos, sin = runner._cos[start : start + t], runner._sin[start : start + t]
    # the torch path: rotary with per-head tables, then write and attend
    cos_h, sin_h = runner._per_head(cos.unsqueeze(0))[0], runner._per_head(sin.unsqueeze(0), sin=True)[0]
    rotated = torch.addcmul(qkv * cos_h, qkv.roll(d // 2, -1), sin_h)
    ref_cache = cache.clone()
    ref_cache[:, :, :, start : start + t] = rotated[:, :, hq:].view(b, t, 2, hkv, d).permute(2, 0, 3, 1, 4)
    want = cpu_linear.causal_attention(rotated[:, :, :hq], ref_cache[0, :, :, : start + t],
                                       ref_cache[1, :, :, : start + t], runner.scale)
    got_cache = cache.clone()
    got = cpu_linear.rope_cache_attention(qkv.clone(), cos, sin, got_cache[0], got_cache[1], start, runner.scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, ref_cache, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_cache[:, :, :, start + t :], cache[:, :, :, start + t :])  # nothing past the new rows
    with pytest.raises(ValueError, match="bad shapes"):
        cpu_linear.rope_cache_attention(qkv.clone(), cos, sin, got_cache[0], got_cache[1], slots - 1, runner.scale)


def test_mask_bits_packs_each_row_into_a_word():
    mask = mask_from_parents([-1, 0, 0, 1])
    assert cpu_linear.mask_bits(mask).tolist() == [0b1, 0b11, 0b101, 0b1011]
    wide = torch.ones(64, 64, dtype=torch.bool).tril()
    assert cpu_linear.mask_bits(wide)[-1].item() == -1  # all 64 bits set (as a signed word)
    with pytest.raises(ValueError, match="T <= 64"):
        cpu_linear.mask_bits(torch.ones(65, 65, dtype=torch.bool))
    with torch.inference_mode():  # kept per tensor, redone when its values change (inference tensors too)
        tree = mask_from_parents([-1, 0, 1])
        assert cpu_linear.mask_bits(tree) is cpu_linear.mask_bits(tree)
        tree[2, 1] = False
        assert cpu_linear.mask_bits(tree).tolist() == [0b1, 0b11, 0b101]


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_attention_matches_sdpa_and_each_node_equals_its_own_decoding_step(threads):
    """A node attends to the prefix, its ancestors and itself; its output is bit for bit what
    one decoding step over the same keys (prefix, ancestors, node, in that order) gives."""
    gen = torch.Generator().manual_seed(threads)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    t, hq, hkv, d, prefix = len(parents), 8, 4, 32, 45
    q = torch.randn(1, t, hq, d, generator=gen)
    k = torch.randn(1, hkv, prefix + t, d, generator=gen)
    v = torch.randn(1, hkv, prefix + t, d, generator=gen)
    mask = mask_from_parents(parents)
    torch.set_num_threads(threads)
    try:
        got = cpu_linear.causal_attention(q, k, v, 0.2, mask=cpu_linear.mask_bits(mask))  # [T, Hq*D]
    finally:
        torch.set_num_threads(2)
    full = torch.cat([torch.ones(t, prefix, dtype=torch.bool), mask], dim=1)  # [T, L]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=full, scale=0.2,
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(t, hq * d), atol=1e-5, rtol=1e-5)
    for node in range(t):
        seen = [prefix + i for i in range(t) if mask[node, i]]  # ancestors then the node, in position order
        keys = torch.cat([k[:, :, :prefix], k[:, :, seen]], dim=2).contiguous()
        values = torch.cat([v[:, :, :prefix], v[:, :, seen]], dim=2).contiguous()
        step = cpu_linear.causal_attention(q[:, node : node + 1], keys, values, 0.2)
        assert torch.equal(step[0], got[node])


def test_attention_past_the_stack_buffer_and_across_threads_is_the_same_bits():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 4, 16, generator=gen), torch.randn(1, 2, 5000, 16, generator=gen),
               torch.randn(1, 2, 5000, 16, generator=gen))  # 5000 keys: the score buffer is allocated
    torch.set_num_threads(1)
    try:
        one = cpu_linear.causal_attention(q, k, v, 0.25)
    finally:
        torch.set_num_threads(2)
    assert torch.equal(cpu_linear.causal_attention(q, k, v, 0.25), one)
    mask = torch.ones(3, 5000, dtype=torch.bool).tril(diagonal=4997)  # query i sees 4998 + i keys
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=0.25,
                                                            enable_gqa=True)
    torch.testing.assert_close(one, want.transpose(1, 2).reshape(3, 64), atol=1e-5, rtol=1e-5)


def test_argmax_follows_torch_on_ties_and_nans():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, float("nan"), 5.0, float("nan")], [-1.0, -1.0, -1.0, -1.0]])
    assert cpu_linear.argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [1, 1, 0]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 4096, generator=gen)
    assert torch.equal(cpu_linear.argmax(logits), torch.argmax(logits, dim=-1))
    assert torch.equal(cpu_linear.argmax(logits[:, -1]), torch.argmax(logits[:, -1], dim=-1))  # a strided view
    assert torch.equal(cpu_linear.argmax(logits.double()), torch.argmax(logits.double(), dim=-1))  # torch's path


def test_argmax_follows_torch_on_long_rows_with_ties_zeros_infs_and_nans():
    """Rows long enough for the vector paths (16 lanes with AVX-512, 8 with AVX2, and their
    tails): the first of tied maxima wherever they sit, -0.0 against +0.0, all -inf, and NaN
    after the maximum or in the tail."""
    gen = torch.Generator().manual_seed(1)
    for cols in (8, 9, 15, 16, 17, 31, 100, 4096, 4103):
        x = torch.randn(12, cols, generator=gen)
        x[1, cols // 3] = x[1, cols - 1] = 50.0  # a tie: the first one wins
        x[2, :] = float("-inf")
        x[3, :] = -1.0
        x[3, cols // 2], x[3, cols // 2 + 1] = -0.0, 0.0  # equal zeros: the first
        x[4, cols - 1] = float("nan")  # a NaN in the tail
        x[5, 0], x[5, cols // 2] = 9.0, float("nan")  # after the maximum
        x[6, cols - 1] = 70.0  # the maximum is the last element
        x[7, :] = 0.0
        x[7, 5 % cols] = float("inf")
        x[8, :] = float("nan")
        assert cpu_linear.argmax(x).tolist() == torch.argmax(x, dim=-1).tolist(), cols


def test_embedding_gathers_in_pieces_what_torch_gathers():
    """`embedding` splits a long gather into pieces under torch's OpenMP grain (so torch never
    wakes its team); the rows are torch's, for a few ids, a piece's worth and prompt lengths."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(4096, 256, generator=gen)
    rows = cpu_linear.TORCH_GRAIN // 256
    for n in (1, 7, rows - 1, rows, rows + 1, 192, 3 * rows + 5):
        ids = torch.randint(0, 4096, (n,), generator=gen)
        got = cpu_linear.embedding(ids, table)
        assert got.shape == (n, 256) and torch.equal(got, torch.nn.functional.embedding(ids, table)), n
    with pytest.raises(IndexError):  # torch's own bounds check still applies to every piece
        cpu_linear.embedding(torch.tensor([0] * 100 + [4096]), table)


@pytest.mark.parametrize("t", [1, 3, 8, 13])
def test_layer_stack_in_one_call_equals_the_per_call_path(t):
    """`llama_layers` runs the same kernel calls the Python loop makes: the same cache contents
    bit for bit (up to the kernel's row count), and logits with the same argmax."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    assert runner.c_layers
    prompt = torch.arange(5, 40).view(1, -1)
    new = torch.arange(100, 100 + t).view(1, -1)
    outs = []
    for c_layers in (True, False):
        runner.c_layers = c_layers
        runner.reset(1)
        runner.forward(prompt)
        out = runner.forward(new, need_hidden=True)
        outs.append((out.logits.clone(), out.hidden.clone(), runner.cache.data[..., : runner.cache.length, :].clone()))
    runner.c_layers = True
    (logits, hidden, cache), (ref_logits, ref_hidden, ref_cache) = outs
    if t <= cpu_linear.MAX_ROWS:  # the per-call path runs the same kernels (above: oneDNN, other rounding)
        assert torch.equal(cache, ref_cache)
    else:
        torch.testing.assert_close(cache, ref_cache, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)  # the final norm: C vs torch rounding
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def _drafts_by_forwards(runner, prompt: torch.Tensor, tokens: list[int], count: int,
                        pick) -> tuple[list[int], torch.Tensor]:
    """Reset, read ``prompt``, then feed ``tokens`` and ``count - 1`` picked tokens one forward at a
    time (pick: the last logits [V] -> a token); the ``count`` picked tokens and the cache left."""
    runner.reset(1)
    runner.forward(prompt)
    ids, loop = torch.tensor([tokens]), []
    for _ in range(count):
        loop.append(pick(runner.forward(ids).logits[0, -1]))
        ids = torch.tensor([[loop[-1]]])
    return loop, runner.cache.data[..., : runner.cache_len, :].clone()


@pytest.mark.parametrize("fed,count", [(1, 1), (1, 4), (2, 6), (5, 3), (16, 8)])
def test_greedy_drafting_in_one_call_equals_the_loop_of_forwards(fed, count):
    """`FastLlamaRunner.draft_chain` (one `specops_llama_draft` call) drafts the tokens a
    loop of forwards and argmaxes does, and leaves the same cache bits and length (neither
    feeds the last token), on the bf16 draft and the fp32 target."""
    from specops.assets import DRAFT_DIR, TARGET_DIR
    from specops.models.fast_llama import FastLlamaRunner
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(fed * 10 + count)
    for path, weights in ((DRAFT_DIR, "bf16"), (TARGET_DIR, "fp32")):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        runner = FastLlamaRunner(model, kernel_weights=weights)
        prompt = torch.randint(0, runner.vocab_size, (1, 30), generator=gen)
        tokens = torch.randint(0, runner.vocab_size, (fed,), generator=gen).tolist()
        loop, want = _drafts_by_forwards(runner, prompt, tokens, count, lambda logits: int(cpu_linear.argmax(logits)))
        runner.reset(1)
        runner.forward(prompt)
        assert runner.draft_chain(tokens, count) == (loop, None)
        assert runner.cache_len == 30 + fed + count - 1
        assert torch.equal(runner.cache.data[..., : runner.cache_len, :], want)


@pytest.mark.parametrize("fed,count", [(1, 5), (2, 4), (9, 3)])
def test_greedy_drafting_over_a_draft_vocabulary_ranks_only_its_rows(fed, count):
    """`set_draft_vocab`: a greedy chain runs the LM head over the listed rows only, and drafts
    what a loop of forwards drafts when each step takes the argmax of the full logits at the
    listed tokens (first in list order on ties): the rows' logits are the full head's bit for
    bit. Sampled chains keep the whole vocabulary; None restores it; bad lists are refused."""
    from specops.assets import DRAFT_DIR
    from specops.models.fast_llama import FastLlamaRunner
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR), dtype=torch.float32).eval()
    runner = FastLlamaRunner(model, kernel_weights="bf16")
    gen = torch.Generator().manual_seed(fed * 7 + count)
    vocab = torch.randperm(runner.vocab_size, generator=gen)[:300]  # unsorted: list order decides ties
    prompt = torch.randint(0, runner.vocab_size, (1, 25), generator=gen)
    tokens = torch.randint(0, runner.vocab_size, (fed,), generator=gen).tolist()
    loop, want = _drafts_by_forwards(runner, prompt, tokens, count,
                                     lambda logits: int(vocab[int(torch.argmax(logits[vocab]))]))
    runner.set_draft_vocab(vocab.tolist())
    runner.reset(1)
    runner.forward(prompt)
    drafted, q = runner.draft_chain(tokens, count)
    assert q is None and drafted == loop and set(drafted) <= set(vocab.tolist())
    assert torch.equal(runner.cache.data[..., : runner.cache_len, :], want)
    runner.reset(1)
    runner.forward(prompt)
    _, q = runner.draft_chain(tokens, count, uniforms=torch.rand(count, generator=gen, dtype=torch.float64))
    assert q.shape == (count, runner.vocab_size)  # sampling: q over the whole vocabulary
    for bad in ([], [1, 1], [runner.vocab_size], [-1], [[1, 2]]):
        with pytest.raises(ValueError, match="draft vocabulary"):
            runner.set_draft_vocab(bad)
    runner.set_draft_vocab(None)
    runner.reset(1)
    runner.forward(prompt)
    full, _ = runner.draft_chain(tokens, count)
    assert full == _drafts_by_forwards(runner, prompt, tokens, count, lambda logits: int(torch.argmax(logits)))[0]


def test_a_decoder_applies_a_draft_vocabulary_and_stays_exact():
    """`Decoder(draft_vocab=)` and a draft folder's ``draft_vocab.json`` (the bundled draft ships
    one): greedy drafting proposes only listed tokens, outputs equal plain decoding; a list
    without a draft model, or for a runner that cannot rank a subset, is a clear error."""
    import json

    from specops.assets import DRAFT_DIR, TARGET_DIR
    from specops.decoder import Decoder
    from specops.spec.errors import InvalidRequestError
    from transformers import AutoModelForCausalLM

    bundled = Decoder.from_pretrained("bundled")
    shipped = json.loads((DRAFT_DIR / "draft_vocab.json").read_text())["tokens"]
    assert torch.equal(bundled.draft._draft_head[2], torch.tensor(shipped))
    target = AutoModelForCausalLM.from_pretrained(str(TARGET_DIR), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR), dtype=torch.float32).eval()
    vocab = list(range(3, 900))
    dec = Decoder(target, draft=draft, draft_vocab=vocab)
    seen = []
    chain = dec.draft.draft_chain
    dec.draft.draft_chain = lambda *a, **k: (lambda out: seen.extend(out[0]) or out)(chain(*a, **k))
    prompt = list(range(40, 80))
    out = dec.generate(prompt, method="draft", max_new_tokens=48)
    assert out.tokens == dec.generate(prompt, method="ar", max_new_tokens=48).tokens
    assert seen and set(seen) <= set(vocab)
    with pytest.raises(InvalidRequestError, match="needs a draft model"):
        Decoder(target, draft_vocab=vocab)
    with pytest.raises(InvalidRequestError, match="draft_vocab"):
        Decoder(target, draft=draft, draft_vocab=[0, 0])
    with pytest.raises(InvalidRequestError, match="fast runner"):
        Decoder(target, draft=draft, impl="hf", draft_vocab=vocab)


@pytest.mark.parametrize("fed,count,temperature", [(1, 4, 1.0), (3, 6, 0.7), (16, 2, 1.3)])
def test_sampled_drafting_in_one_call_draws_from_the_q_it_returns(fed, count, temperature):
    """With uniforms, each drafted token is the inverse-CDF draw of its uniform from the q row
    returned beside it; q is softmax(logits / T) of the logits a loop of forwards over the
    same tokens computes, and the cache holds what that loop writes."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    gen = torch.Generator().manual_seed(fed + count)
    prompt = torch.randint(0, runner.vocab_size, (1, 30), generator=gen)
    tokens = torch.randint(0, runner.vocab_size, (fed,), generator=gen).tolist()
    uniforms = torch.rand(count, generator=gen, dtype=torch.float64)
    runner.reset(1)
    runner.forward(prompt)
    drafted, q = runner.draft_chain(tokens, count, uniforms=uniforms, temperature=temperature)
    got_cache = runner.cache.data[..., : runner.cache_len, :].clone()
    assert len(drafted) == count and q.shape == (count, runner.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(count, dtype=torch.float32), atol=1e-5, rtol=0)
    for g in range(count):
        cdf = torch.cumsum(q[g], 0, dtype=torch.float64)
        assert drafted[g] == int(torch.searchsorted(cdf, uniforms[g] * cdf[-1], right=True))
        assert q[g, drafted[g]] > 0
    runner.reset(1)
    runner.forward(prompt)
    ids = torch.tensor([tokens])
    for g in range(count):  # the loop, fed the drafted tokens
        logits = runner.forward(ids).logits[0, -1]
        torch.testing.assert_close(q[g], torch.softmax(logits / temperature, -1), atol=2e-6, rtol=1e-4)
        ids = torch.tensor([[drafted[g]]])
    assert torch.equal(runner.cache.data[..., : runner.cache_len, :], got_cache)
    with pytest.raises(ValueError, match="uniforms"):
        runner.draft_chain(tokens, count, uniforms=uniforms.float())


def test_greedy_drafting_declines_what_the_c_forward_would_not_take():
    """None, the cache untouched, where `forward` would leave the C stack (too many tokens, a
    prefill from an empty cache, no room left) or the chain asks for nothing; bad ids raise."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    runner.reset(1)
    assert runner.draft_chain([5, 6], 2) is None  # a prompt pass on an empty cache: torch's path
    runner.forward(torch.arange(5, 40).view(1, -1))
    assert runner.draft_chain(list(range(17)), 2) is None  # wider than the C stack
    assert runner.draft_chain([5], 0) is None
    room = runner.max_context - runner.cache_len
    assert runner.draft_chain([5], room + 1) is None  # would run past the cache
    assert runner.cache_len == 35
    with pytest.raises(ValueError, match="token ids"):
        runner.draft_chain([runner.vocab_size], 2)
    assert runner.draft_chain([5], room) is not None and runner.cache_len == runner.max_context


def test_a_tree_forward_through_the_layer_stack_equals_decoding_its_path():
    """Verifying a tree in one C call gives every node of a root-to-leaf path the logits its
    own decoding steps would (same keys in the same order: bit for bit)."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    prompt = torch.arange(5, 60).view(1, -1)
    parents = [-1, 0, 0, 1, 1, 3]
    tokens = torch.tensor([[7, 11, 12, 13, 14, 15]])
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    runner.reset(1)
    runner.forward(prompt)
    start = runner.cache_len
    tree = runner.forward(tokens, position_ids=(start + depth)[None], tree_mask=mask_from_parents(parents)).logits[0]
    path = [0, 1, 3, 5]
    runner.truncate(start)
    for node in path:
        step = runner.forward(tokens[:, node : node + 1]).logits[0, 0]
        assert torch.equal(step, tree[node])


def test_bf16_weights_are_widened_exactly_and_keep_the_row_and_thread_invariance():
    """A bfloat16 weight (a draft model's kernel copy) computes what its fp32 widening does,
    with the same bits for any row count or thread count. A build without AVX-512 BW/VL
    refuses bf16 weights with a clear error, and `PackedLinear` keeps fp32 copies there."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 264, generator=gen), torch.randn(300, 264, generator=gen).to(torch.bfloat16)
    b = torch.randn(300, generator=gen)
    layer = PackedLinear(w.float(), b, onednn=False, kernel_bf16=True)
    if not cpu_linear.bf16_weights():
        assert layer.weight.dtype == torch.float32
        with pytest.raises(ValueError, match="bfloat16"):
            cpu_linear.linear(x, w, b)
        return
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(cpu_linear.unpack(layer.weight), w)
    assert torch.equal(layer(x), cpu_linear.linear(x, w, b))
    want = cpu_linear.linear(x, w.float(), b, threads=1)  # the same values, stored as fp32
    assert torch.equal(cpu_linear.linear(x, w, b, threads=1), want)
    assert torch.equal(cpu_linear.linear(x, w, b, threads=2), want)
    for t in range(7):
        assert torch.equal(cpu_linear.linear(x[t : t + 1].contiguous(), w, b, threads=2)[0], want[t])


def test_a_runner_with_bf16_kernel_weights_runs_the_c_stack_and_stays_close():
    from specops.assets import DRAFT_DIR
    from specops.models.fast_llama import FastLlamaRunner
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DRAFT_DIR), dtype=torch.float32).eval()
    half = FastLlamaRunner(model, kernel_weights="bf16")
    full = FastLlamaRunner(model)
    expected = "bf16" if cpu_linear.bf16_weights() else "fp32"  # fp32 copies where the build cannot read bf16
    assert half.kernel_weights == expected and half.c_layers
    assert half.layers[0].qkv.weight.dtype == (torch.bfloat16 if expected == "bf16" else torch.float32)
    assert full.kernel_weights == "fp32"
    outs = []
    for runner in (half, full):
        runner.reset(1)
        runner.forward(torch.arange(3, 40).view(1, -1))  # the prompt pass: torch, fp32 in both
        outs.append(runner.forward(torch.tensor([[41, 42, 43]])).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="kernel_weights"):
        FastLlamaRunner(model, kernel_weights="int8")


def test_the_decoder_drafts_with_bf16_kernel_weights_and_stays_exact():
    from specops.decoder import Decoder

    dec = Decoder.from_pretrained("bundled")
    assert dec.draft.kernel_weights == ("bf16" if cpu_linear.bf16_weights() else "fp32")
    assert dec.target.kernel_weights == "fp32"
    prompt = torch.arange(10, 60).view(1, -1)
    ar = dec.generate(prompt, method="ar", max_new_tokens=48, temperature=0.0).tokens
    draft = dec.generate(prompt, method="draft", max_new_tokens=48, temperature=0.0)
    assert draft.tokens == ar and draft.stats.accepted > 0


def test_sampled_verification_in_one_call_makes_verify_samplings_choices():
    """`verify_sampled` (softmax and rejection sampling in C) takes the same uniforms in the
    same roles as `verify.verify_sampling`, so on the same generator state it accepts the
    same prefix and draws the same next token (a row's softmax rounds differently in C, so a
    uniform landing within a rounding step of a boundary may differ: none did in 600 cases
    when this was written), with drafted tokens from q, off q, and a deterministic drafter."""
    from specops.spec.verify import verify_sampling

    gen = torch.Generator().manual_seed(123)
    differ, accepted_total = 0, 0
    for case in range(600):
        g, vocab = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(2, 300, (1,), generator=gen))
        temperature = float(torch.rand(1, generator=gen)) * 1.5 + 0.3
        logits = torch.randn(g + 1, vocab, generator=gen) * 3
        q = torch.softmax(torch.randn(g, vocab, generator=gen) * 2, -1) if case % 3 else None
        draft = [int(torch.randint(0, vocab, (1,), generator=gen)) for _ in range(g)]
        if q is not None and case % 2:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(g)]
        p = torch.softmax(logits / temperature, -1)[None]
        ref = verify_sampling(torch.tensor([draft]), p, None if q is None else q[None],
                              torch.Generator().manual_seed(case))
        got = cpu_linear.verify_sampled(logits, draft, q, temperature, torch.Generator().manual_seed(case))
        differ += got != (int(ref.accepted[0]), int(ref.next_tokens[0]))
        accepted_total += got[0]
    assert differ <= 3 and accepted_total > 100  # many blocks were (partly) accepted: both branches ran
    with pytest.raises(ValueError, match="logits"):
        cpu_linear.verify_sampled(torch.randn(3, 10), [1], None, 1.0, gen)
    with pytest.raises(ValueError, match="drafted tokens"):
        cpu_linear.verify_sampled(torch.randn(2, 10), [10], None, 1.0, gen)
    with pytest.raises(ValueError, match="temperature"):
        cpu_linear.verify_sampled(torch.randn(2, 10), [1], None, 0.0, gen)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_the_narrower_instruction_set_builds_compute_the_same_way(isa, tmp_path):
    """The kernel has a path per instruction set (AVX-512, AVX2 + FMA, plain C) and CI runs
    only the host's: each narrower one is built here too, and must match addmm and give
    every row the same bits for any row count, thread count and panel tail."""
    import ctypes
    import os
    import platform

    from specops.kernels import cbuild

    # x86 flags pick the path; elsewhere (no such paths) both builds are the host's own, still checked
    flags = {"avx2": ["-mavx2", "-mfma", "-mno-avx512f"], "scalar": ["-mno-avx2", "-mno-fma", "-mno-avx512f"]}[isa]
    flags = flags if platform.machine() in ("x86_64", "AMD64") else []
    cc = os.environ.get("CC") or "cc"
    lib_path = tmp_path / f"linear_{isa}.so"
    proc = subprocess.run([cc, *cbuild.CFLAGS, *flags, "-o", str(lib_path), str(cpu_linear.SOURCE), "-lm"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.specops_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                                   ctypes.c_float]
    gen = torch.Generator().manual_seed(11)
    # nine whole panels and a tail of 12, over two threads in chunks of 64 rows; k over two and a
    # part of AVX2's k chunks (64), rows past its group of 16
    k, n = 150, 300
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_linear.pack(w)
    x, add = torch.randn(19, k, generator=gen), torch.randn(19, n, generator=gen)

    def call(rows: int, threads: int) -> torch.Tensor:
        y = torch.empty(rows, n)
        assert fn(x[:rows].data_ptr(), packed.data_ptr(), b.data_ptr(), add[:rows].data_ptr(), y.data_ptr(),
                  rows, k, n, threads, 0, None, 0.0) == 0
        return y

    full = call(19, 1)
    want = torch.addmm(b.double(), x.double(), w.double().t()).float() + add
    torch.testing.assert_close(full, want, atol=2e-5 * k**0.5, rtol=1e-5)
    for rows in (1, 2, 3, 8, 16, 17):
        for threads in (1, 2):
            assert torch.equal(call(rows, threads), full[:rows]), (rows, threads)
