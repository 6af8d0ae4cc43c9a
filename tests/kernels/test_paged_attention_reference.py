"""The paged-attention reference (`specops.kernels.paged_attention`) against a per-query loop,
and the wrapper's checks. The Triton kernel is checked in `interp_paged_attention.py`."""

from __future__ import annotations

import pytest
import torch

from specops.kernels.paged_attention import paged_attention
from tests.kernels.paged_cases import paged_steps, ragged_case


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (8, 1)], ids=["gqa2", "mha", "mqa"])
def test_reference_matches_a_per_query_loop(tree, heads):
    args, want = ragged_case(1, hq=heads[0], hkv=heads[1], tree=tree)
    out = torch.full_like(want, float("nan"))
    paged_attention(**args, out=out, impl="torch")
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def test_padded_queries_write_nothing():
    args, want = ragged_case(2)
    out = torch.full_like(want, 7.0)
    args["q_index"][args["visible"] == 0] = 0  # padding points at row 0, a real token's row
    paged_attention(**args, out=out, impl="torch")
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def test_the_wrapper_names_what_is_wrong():
    args, want = ragged_case(3)
    out = torch.empty_like(want)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(**{**args, "k_store": args["k_store"][:, :1].repeat(1, 3, 1),
                           "v_store": args["v_store"][:, :1].repeat(1, 3, 1)}, out=out)
    with pytest.raises(ValueError, match="mask must be"):
        paged_attention(**{**args, "mask": torch.ones(1, 1, 1, dtype=torch.bool)}, out=out)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(**args, out=out[:, :-1])
    with pytest.raises(ValueError, match="impl"):
        paged_attention(**args, out=out, impl="cuda")
    with pytest.raises(ValueError, match="share one of"):
        paged_attention(**{**args, "q": args["q"].double()}, out=out)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check runs it)")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_the_triton_kernel_on_cuda_matches_the_reference(dtype, tree):
    args, want = ragged_case(11, hq=8, hkv=2, d=64, seqs=((300, 1), (17, 5), (0, 4), (1000, 1)), tree=tree,
                             dtype=dtype)
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = torch.zeros(want.shape, dtype=dtype, device="cuda")
    paged_attention(**args, out=out, impl="auto")  # auto: Triton on CUDA
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float().cpu(), want, atol=tol, rtol=tol)


@CUDA
def test_the_paged_model_runs_its_attention_on_the_kernel_on_cuda():
    """On CUDA the serving engine's paged forward reads the KV in place through the Triton kernel
    (plain steps, chain drafts and trees) and matches its SDPA path."""
    from specops.models.fast_llama import FastLlamaRunner
    from specops.engine.batch_forward import PagedBackend
    from specops.engine.kv_pool import BlockPool
    from tests.decoder.tiny_models import tiny_llama

    runner = FastLlamaRunner(tiny_llama(seed=0).cuda())
    outs = []
    for kernel in (False, True):
        pool = BlockPool(32, 4)
        backend = PagedBackend(runner, pool)
        assert backend.model.gpu_kernel
        backend.model.gpu_kernel = kernel
        outs.append(paged_steps(backend, pool))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
