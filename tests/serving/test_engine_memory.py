"""The engine's KV memory: a fixed budget under a burst (preemption, still exact), aborts free
blocks, and the counter invariants of style-serving.md checked on every step:

* tokens a step schedules = committed + drafts - computed;
* after verification the computed count is the scheduled one minus the rejected drafts;
* the draft model's paged KV rolls back like the target's (equals a fresh prefill);
* the accepted Medusa tree path's KV ends up contiguous (equals a fresh prefill).
"""

from __future__ import annotations

import pytest
import torch

from specops.decoder import Decoder
from specops.models.medusa_heads import MedusaHeads
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.tiny_models import perturbed, tiny_other
from tests.serving.test_engine import _random_prompts, full_speculation

METHODS = ("ar", "draft", "ngram", "medusa")


@pytest.fixture(scope="module")
def dec():
    torch.set_num_threads(1)
    target = tiny_other("qwen2", seed=11, vocab=96)
    draft = perturbed(target, noise=0.2, seed=12)
    return Decoder(target, draft=draft, medusa=MedusaHeads.from_model(target, 3))


def check_blocks(eng: Engine) -> None:
    """No block is lost, a block's reference count is the number of tables holding it (only
    prefix-cached target blocks are shared), and every sequence holds blocks for its computed KV."""
    for pool, role in ((eng.pool, "target"), (eng.draft_pool, "draft")):
        if pool is None:
            continue
        counts: dict[int, int] = {}
        for s in eng.seqs.values():
            for b in getattr(s, role).blocks:
                counts[b] = counts.get(b, 0) + 1
        assert len(counts) == pool.num_used and all(pool.refcount(b) == n for b, n in counts.items())
        assert role == "target" or all(n == 1 for n in counts.values())
        assert pool.num_used + pool.num_free == pool.num_blocks
        for s in eng.seqs.values():
            kv = getattr(s, role)
            assert len(kv.blocks) * pool.block_size >= kv.computed


def test_burst_under_a_small_budget_preempts_and_stays_exact(dec):
    budget_mb = 0.05  # ~100 token slots per model: a few sequences at a time
    eng = full_speculation(Engine(dec, max_batch=8, kv_cache_mb=budget_mb, block_size=8, calibrate=False))
    store_bytes = sum(b.model.store.numel() * b.model.store.element_size() for b in (eng.target, eng.draft))
    assert store_bytes <= budget_mb * 2**20  # the storage itself fits the budget
    prompts = _random_prompts(10, seed=4)
    want = {}
    for i, p in enumerate(prompts):
        rid = f"{METHODS[i % 4]}-{i}"
        eng.add(rid, p, SamplingParams(max_tokens=40), SpecSettings(method=METHODS[i % 4], gamma=3, tree_size=6))
        want[rid] = dec.generate(p, method="ar", max_new_tokens=40).tokens
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        st = eng.stats()
        assert st.kv_blocks_used <= st.kv_blocks_total
        check_blocks(eng)
    assert got == want
    assert eng.stats().preemptions > 0  # the burst really overflowed the cache
    assert eng.pool.peak_used <= eng.pool.num_blocks
    assert eng.pool.num_used == eng.draft_pool.num_used == 0


def test_abort_frees_blocks_at_the_next_step(dec):
    eng = Engine(dec, max_batch=4, kv_cache_mb=1, calibrate=False)
    for i in range(3):
        eng.add(f"r{i}", [1, 2, 3, 4, 5] * 6, SamplingParams(max_tokens=50), SpecSettings(method=METHODS[i + 1]))
    for _ in range(4):
        eng.step()
    victim = eng.seqs["r1"]
    held = len(victim.target.blocks) + len(victim.draft.blocks)
    assert held > 0
    used_before = eng.pool.num_used + eng.draft_pool.num_used
    eng.abort("r1")
    eng.abort("nope")  # unknown ids are ignored
    outs = eng.step()
    final = [o for o in outs if o.request_id == "r1"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "abort" and final[0].new_token_ids == []
    assert "r1" not in eng.seqs and victim.target.blocks == [] and victim.draft.blocks == []
    check_blocks(eng)
    assert eng.pool.num_used + eng.draft_pool.num_used <= used_before - held + 2 * len(eng.seqs)
    while eng.has_unfinished():
        assert all(o.request_id != "r1" for o in eng.step())
    assert eng.pool.num_used == eng.draft_pool.num_used == 0


def _contiguous_kv(runner, tokens: list[int]) -> torch.Tensor:  # -> [NL, 2, L, Hkv, D]
    runner.reset(1)
    runner.forward(torch.tensor([tokens]))
    return runner.cache.data[:, :, 0, :, : len(tokens)].permute(0, 1, 3, 2, 4)


def _paged_kv(backend, kv) -> torch.Tensor:  # -> [NL, 2, L, Hkv, D]
    bs = backend.bs
    slots = torch.tensor([kv.blocks[p // bs] * bs + p % bs for p in range(kv.computed)])
    return backend.model.store[:, :, slots]


def test_step_invariants_and_kv_contents(dec):
    eng = full_speculation(Engine(dec, max_batch=8, kv_cache_mb=1, calibrate=False))
    for i, p in enumerate(_random_prompts(8, seed=9)):
        eng.add(f"{METHODS[i % 4]}-{i}", p, SamplingParams(max_tokens=30),
                SpecSettings(method=METHODS[i % 4], gamma=1 + i % 4, tree_size=5 + i))
    forward = eng.target.forward
    seen: dict[int, tuple] = {}

    def spy(items, need_hidden=False):
        for it in items:
            seq = next(s for s in eng.seqs.values() if s.target is it.kv)
            seen[id(seq)] = (seq, it.kv.computed, len(seq.tokens), len(it.tokens))
        return forward(items, need_hidden)

    eng.target.forward = spy
    compact = eng.target.compact
    moved_paths: list[list[int]] = []

    def spy_compact(kv, start, keep):
        if keep != list(range(len(keep))):
            moved_paths.append(list(keep))
        return compact(kv, start, keep)

    eng.target.compact = spy_compact
    spec_steps = 0
    while eng.has_unfinished():
        seen.clear()
        outs = {o.request_id: o for o in eng.step()}
        for seq, computed, committed, scheduled in seen.values():
            drafts = scheduled - (committed - computed)
            assert drafts >= 0 and (drafts == 0 or computed == committed - 1)  # drafts only on decode steps
            emitted = len(outs[seq.request_id].new_token_ids)
            if not outs[seq.request_id].finished:
                rejected = drafts - (emitted - 1)
                # computed after verification = scheduled tokens' positions minus the rejected drafts
                assert seq.target.computed == computed + scheduled - rejected == len(seq.tokens) - 1
                spec_steps += drafts > 0
                assert seq.draft.computed <= len(seq.tokens) - 1
        for seq in eng.seqs.values():
            if seq.target.computed:
                ref = _contiguous_kv(dec.target, seq.tokens[: seq.target.computed])
                torch.testing.assert_close(_paged_kv(eng.target, seq.target), ref, atol=1e-4, rtol=1e-4)
            if seq.spec.method == "draft" and seq.draft.computed:
                ref = _contiguous_kv(dec.draft, seq.tokens[: seq.draft.computed])
                # the draft's decoding steps read bf16 kernel weights (its prompt pass fp32): the
                # reference, one fp32 prompt pass, agrees to bf16 precision; a wrong slot is off by O(1)
                tol = 5e-2 if getattr(dec.draft, "kernel_weights", "fp32") == "bf16" else 1e-4
                torch.testing.assert_close(_paged_kv(eng.draft, seq.draft), ref, atol=tol, rtol=tol)
    assert spec_steps > 10
    assert moved_paths  # some accepted tree paths really needed moving (then checked contiguous above)


def _spy_prefills(eng: Engine) -> dict[str, int]:
    """Tokens each request fed its first forward (its prefill), filled in as ``eng`` steps."""
    fed: dict[str, int] = {}
    forward = eng.target.forward

    def spy(items, need_hidden=False):
        for it in items:
            seq = next(s for s in eng.seqs.values() if s.target is it.kv)
            fed.setdefault(seq.request_id, len(it.tokens))  # first feed: the prefill
        return forward(items, need_hidden)

    eng.target.forward = spy
    return fed


def test_prefix_cache_reuses_prompt_blocks_and_stays_exact(dec):
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=1, block_size=4, calibrate=False))
    fed = _spy_prefills(eng)
    prompt = [(7 * i) % 96 for i in range(30)]
    requests = {"a": prompt, "b": prompt + [5, 6], "c": prompt, "d": prompt[:9] + [1, 2, 3]}
    methods = {"a": "ar", "b": "ngram", "c": "medusa", "d": "draft"}
    got: dict[str, list[int]] = {}

    def run(rids):
        for rid in rids:
            eng.add(rid, requests[rid], SamplingParams(max_tokens=12), SpecSettings(method=methods[rid]))
        shared = False
        while eng.has_unfinished():
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            shared |= any(eng.pool.refcount(b) > 1 for s in eng.seqs.values() for b in s.target.blocks)
            check_blocks(eng)
        return shared

    run(["a"])
    assert fed["a"] == 30 and eng.pool.num_used == 0
    assert run(["b", "c", "d"])  # b and c share a's cached blocks at the same time
    assert fed["b"] == 32 - 28 and fed["c"] == 30 - 28 and fed["d"] == 12 - 8  # only the uncached rest
    for rid, p in requests.items():
        assert got[rid] == dec.generate(p, method="ar", max_new_tokens=12).tokens, rid
    assert eng.pool.num_used == 0 and eng.pool.cache_hits == 7 + 7 + 2


def test_a_prompt_admitted_with_a_same_prefix_waits_a_step_and_reuses_its_blocks(dec):
    """Cold cache, four requests at once: "b" and "d" share "a"'s prompt blocks, which nobody
    has computed yet. Admitted in a's step they would compute them again; put off one step
    (FIFO: "c" and "d" behind it wait too), they find a's blocks published."""
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=1, block_size=4, calibrate=False))
    fed = _spy_prefills(eng)
    prompt = [(7 * i) % 96 for i in range(30)]
    requests = {"a": prompt, "b": prompt + [5, 6], "c": [(5 * i + 3) % 96 for i in range(13)], "d": prompt}
    methods = {"a": "ar", "b": "ngram", "c": "draft", "d": "medusa"}
    for rid in requests:
        eng.add(rid, requests[rid], SamplingParams(max_tokens=12), SpecSettings(method=methods[rid]))
    got: dict[str, list[int]] = {}
    first = True
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if first:
            assert list(fed) == ["a"] and [s.request_id for s in eng.scheduler.waiting] == ["b", "c", "d"]
            first = False
        check_blocks(eng)
    assert fed == {"a": 30, "b": 32 - 28, "c": 13, "d": 30 - 28}
    assert eng.stats().prefix_deferrals == 1 and eng.pool.cache_hits == 7 + 7
    for rid, p in requests.items():
        assert got[rid] == dec.generate(p, method="ar", max_new_tokens=12).tokens, rid
    assert eng.pool.num_used == 0


def test_the_default_budget_holds_a_full_batch_at_full_context_twice(dec):
    from specops.engine.batch_forward import bytes_per_token
    from specops.engine.kv_budget import auto_kv_cache_mb

    per_slot = bytes_per_token(dec.target) + bytes_per_token(dec.draft)
    assert auto_kv_cache_mb(per_slot, 4, 128) == 2 * 4 * 128 * per_slot / 2**20
    eng = Engine(dec, max_batch=4, kv_cache_mb=None, block_size=8, calibrate=False)
    assert eng.pool.capacity_slots == 2 * 4 * dec.target.max_context
    assert eng.kv_bytes == 2 * 4 * dec.target.max_context * per_slot
    for bad in (0, -1.0, True, "64"):
        with pytest.raises(ValueError, match="kv_cache_mb"):
            Engine(dec, max_batch=4, kv_cache_mb=bad, calibrate=False)
