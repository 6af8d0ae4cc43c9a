"""The CPU linear kernel (`specops.kernels.cpu_linear`): right, and the same bits for any
number of rows or threads (what keeps speculation's verify forwards equal to plain steps)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from specops.decoder.packed_linear import PackedLinear
from specops.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C compiler")


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
    k, n = 264, 1100  # a tail after the 16-wide blocks, and an 8-wide one; a partial last chunk
    x, w, b = torch.randn(7, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    one_thread = cpu_linear.linear(x, w, b, threads=1)
    assert torch.equal(cpu_linear.linear(x, w, b, threads=threads), one_thread)
    for t in range(7):  # a row alone, and in blocks of 2..4 at other offsets
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


def test_a_forked_child_still_runs_the_kernel():
    """The pool's threads do not survive fork(); the child must not wait for them."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
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
    assert layer.kernel_rows == cpu_linear.MAX_ROWS and layer.weight_t is None
    for rows in (1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 5):
        x, r = torch.randn(rows, 64, generator=gen), torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(layer(x), torch.addmm(b, x, w.t()), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(layer.add_to(r, x), r + torch.addmm(b, x, w.t()), atol=1e-4, rtol=1e-5)
    plain = PackedLinear(w, b, onednn=False, cpu_kernel=False)
    assert plain.kernel_rows == 0 and plain.weight is None


def test_a_verify_forward_gives_the_logits_of_one_position_forwards():
    """With the kernel, the fast runner's 5-position forward after a prefix equals five
    1-position forwards bit for bit in every linear layer; attention's SDPA vs grouped
    paths still round differently, so the logits are compared to float tolerance, and
    the argmax exactly."""
    from specops.decoder import Decoder

    runner = Decoder.from_pretrained("bundled").target
    prompt = torch.arange(3, 40).view(1, -1)
    new = torch.tensor([[7, 8, 9, 10, 11]])
    runner.reset(1)
    runner.forward(prompt)
    wide = runner.forward(new).logits[0]  # [5, V]
    runner.reset(1)
    runner.forward(prompt)
    narrow = torch.cat([runner.forward(new[:, i : i + 1]).logits[0] for i in range(5)])  # [5, V]
    torch.testing.assert_close(wide, narrow, atol=1e-4, rtol=1e-4)
    assert torch.equal(wide.argmax(-1), narrow.argmax(-1))
