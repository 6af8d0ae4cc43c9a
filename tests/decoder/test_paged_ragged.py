"""`PagedLlama.forward_ragged` (the whole layer stack of a ragged batch in one C call) against
the fast runner's single-sequence forward: the same logits bit for bit, for prefill chunks,
plain steps, chain verifications and Medusa trees of several sequences at once, on scattered
block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specops.models.fast_llama import FastLlamaRunner
from specops.models.paged_llama import PagedLlama
from specops.kernels import cpu_linear
from specops.engine.batch_forward import FeedItem, PagedBackend
from specops.engine.kv_pool import BlockPool
from specops.engine.sequence import SeqKV
from tests.decoder.tiny_models import tiny_llama, tiny_other
from tests.kernels.trees import mask_from_parents
from tests.services import require_binary

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_binary("cc", "gcc")
    assert cpu_linear.available(), cpu_linear.unavailable_reason()


def _models():
    torch.manual_seed(0)
    return {"llama": tiny_llama(seed=3, vocab=96, layers=2, hidden=64),
            "qwen2": tiny_other("qwen2", seed=4, vocab=96)}  # q/k/v biases, grouped kv heads


def _steps(rng: np.random.Generator) -> list[list[dict]]:
    """Per step, what each of three sequences feeds: tokens, and a tree (parents) or None."""
    def toks(n):
        return rng.integers(3, 96, n).tolist()

    parents = [-1, 0, 0, 1, 1, 2, 3]
    return [
        [dict(t=toks(1)), dict(t=toks(1)), dict(t=toks(1))],  # first tokens (the runner's C path needs a cache)
        [dict(t=toks(13)), dict(t=toks(5)), dict(t=toks(16))],  # prefill chunks
        [dict(t=toks(1)), dict(t=toks(6)), dict(t=toks(1))],  # plain steps and a chain verification
        [dict(t=toks(7), tree=parents), dict(t=toks(1)), dict(t=toks(4))],  # a tree beside a plain step
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_batch_equals_single_sequence_forwards_bit_for_bit(arch):
    torch.set_num_threads(2)
    model = _models()[arch]
    runner = FastLlamaRunner(model, max_context=128)
    assert runner.c_layers
    paged = PagedLlama(runner, num_blocks=48, block_size=BLOCK)
    assert paged.c_layers
    rng = np.random.default_rng(7)
    order = rng.permutation(48).tolist()  # scattered blocks, interleaved between sequences
    tables = [order[0:16:1], order[16:32], order[32:48]]
    refs = [FastLlamaRunner(model, max_context=128) for _ in range(3)]
    for ref in refs:
        ref.reset(1)
    lengths = [0, 0, 0]
    for step in _steps(rng):
        ids, pos, rows, words = [], [], [], []
        first, start, masked = [0], [], []
        expect = []
        for s, feed in enumerate(step):
            t = len(feed["t"])
            tree = feed.get("tree")
            mask = None if tree is None else mask_from_parents(tree)
            if tree is None:
                p = list(range(lengths[s], lengths[s] + t))
            else:  # depth of each node after the prefix
                depth = [0] * t
                for i, parent in enumerate(tree):
                    depth[i] = 0 if parent < 0 else depth[parent] + 1
                p = [lengths[s] + d for d in depth]
            out = refs[s].forward(torch.tensor([feed["t"]]), position_ids=torch.tensor([p]) if tree else None,
                                  tree_mask=mask)
            expect.append(out.logits[0])  # [T, V]
            rows.extend(range(len(ids), len(ids) + t))
            ids.extend(feed["t"])
            pos.extend(p)
            words.append(np.zeros(t, dtype=np.int64) if mask is None else cpu_linear.mask_bits(mask).numpy())
            start.append(lengths[s])
            masked.append(0 if mask is None else 1)
            first.append(len(ids))
            lengths[s] += t
        batch = cpu_linear.RaggedBatch(positions=np.array(pos, dtype=np.int32), first=np.array(first),
                                       start=np.array(start), tables=np.array(tables, dtype=np.int32),
                                       block_size=BLOCK, words=np.concatenate(words), masked=np.array(masked, np.int8))
        logits, hidden = paged.forward_ragged(torch.tensor(ids), batch, torch.tensor(rows), need_hidden=True)
        assert hidden is not None and hidden.shape == (len(ids), runner.hidden_size)
        got = torch.split(logits, [len(f["t"]) for f in step])
        for s in range(3):
            assert torch.equal(got[s], expect[s]), f"{arch}: sequence {s} differs by {(got[s] - expect[s]).abs().max()}"
    # every key / value landed in its slot: the store holds what each sequence's dense cache holds
    for s in range(3):
        slots = [tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(lengths[s])]
        keys = paged.store[0, 0, slots]  # [L, Hkv, D]
        assert torch.equal(keys, refs[s].cache.keys[0][0, :, : lengths[s]].transpose(0, 1))


def test_the_paged_backend_takes_the_c_path_and_matches_the_per_layer_path():
    """The engine's backend: the same steps through the C layer stack and through the per-layer
    path (the kernel attention groups and SDPA) give the same greedy tokens and close logits."""
    torch.set_num_threads(2)
    model = _models()["qwen2"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 96, n).tolist() for n in (9, 23, 4)]
    results = {}
    for use_c in (True, False):
        runner = FastLlamaRunner(model, max_context=128)
        pool = BlockPool(num_blocks=64, block_size=BLOCK)
        backend = PagedBackend(runner, pool)
        backend.model.c_layers = use_c
        calls = []
        real = backend._forward_c
        backend._forward_c = lambda items, hidden, real=real: (calls.append(len(items)), real(items, hidden))[1]
        kvs = [SeqKV() for _ in prompts]
        logits = []
        for kv, p in zip(kvs, prompts):
            pool.grow(kv.blocks, len(p) + 16)
        out = backend.forward([FeedItem(kv=kv, tokens=p, rows=[len(p) - 1]) for kv, p in zip(kvs, prompts)])
        logits.append(torch.cat([o.logits for o in out]))
        nxt = [int(o.logits[-1].argmax()) for o in out]
        for _ in range(5):
            out = backend.forward([FeedItem(kv=kv, tokens=[t], rows=[0]) for kv, t in zip(kvs, nxt)])
            logits.append(torch.cat([o.logits for o in out]))
            nxt = [int(o.logits[-1].argmax()) for o in out]
        results[use_c] = torch.cat(logits)
        assert (len(calls) > 0) == use_c
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-4)
    assert torch.equal(results[True].argmax(-1), results[False].argmax(-1))


def test_refused_batches_are_errors_not_crashes():
    model = _models()["llama"]
    runner = FastLlamaRunner(model, max_context=128)
    paged = PagedLlama(runner, num_blocks=32, block_size=BLOCK)
    ok = dict(positions=np.array([0, 1], dtype=np.int32), first=np.array([0, 2]), start=np.array([0]),
              tables=np.array([[0, 1]], dtype=np.int32), block_size=BLOCK, words=np.zeros(2, dtype=np.int64),
              masked=np.zeros(1, dtype=np.int8))
    paged.forward_ragged(torch.tensor([5, 6]), cpu_linear.RaggedBatch(**ok), torch.tensor([1]))
    with pytest.raises(ValueError, match="disagree"):
        paged.forward_ragged(torch.tensor([5, 6, 7]), cpu_linear.RaggedBatch(**ok), torch.tensor([1]))
    with pytest.raises(ValueError, match="rotary position"):
        far = dict(ok, positions=np.array([0, 128], dtype=np.int32))
        paged.forward_ragged(torch.tensor([5, 6]), cpu_linear.RaggedBatch(**far), torch.tensor([1]))
    with pytest.raises(ValueError, match="shapes"):  # a tree of more than 64 new tokens has no mask words
        big = dict(ok, positions=np.arange(65, dtype=np.int32), first=np.array([0, 65]), masked=np.ones(1, np.int8),
                   words=np.zeros(65, dtype=np.int64), tables=np.array([list(range(17))], dtype=np.int32))
        paged.forward_ragged(torch.arange(65) % 90, cpu_linear.RaggedBatch(**big), torch.tensor([0]))
    with pytest.raises(ValueError, match="shapes"):  # more tokens than the block table holds
        short = dict(ok, positions=np.arange(9, dtype=np.int32), first=np.array([0, 9]),
                     words=np.zeros(9, dtype=np.int64))
        paged.forward_ragged(torch.arange(9), cpu_linear.RaggedBatch(**short), torch.tensor([0]))
    with pytest.raises(ValueError, match="outside"):
        paged.forward_ragged(torch.tensor([5, 6]), cpu_linear.RaggedBatch(**dict(ok, tables=np.array([[0, 32]], np.int32))),
                             torch.tensor([1]))
    with pytest.raises(ValueError, match="logit rows"):
        paged.forward_ragged(torch.tensor([5, 6]), cpu_linear.RaggedBatch(**ok), torch.tensor([2]))
