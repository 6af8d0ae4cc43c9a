"""Method ``eagle`` in the serving engine: an EAGLE drafter with one cache per sequence.

Greedy output equals plain decoding token for token alone and in a batch of mixed methods
(ar, ngram, eagle) joining mid-batch, under preemption, past a deadline and once a sequence
outgrows the drafter's context (plain to the end, ``fallback_reason`` "deadline" /
"draft_context", the drafter state freed); the engine's per-sequence drafter cache holds what
`Decoder.generate(method="eagle")`'s holds for the same sequence and proposes the same chain;
sampled requests repeat themselves with a seed and follow the target's distribution; ``auto``
chooses eagle among the loaded methods; an abort frees the drafter state; an engine without a
drafter refuses the method (the policy runtime decodes such a class plainly); ``specops serve
--eagle`` reaches the decoder. The drafter is the one tests/decoder/test_eagle.py trains on the
bundled target (once per process).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from specops.decoder import Decoder
from specops.spec import eagle as eagle_module
from specops.spec.eagle import draft_chain
from specops.models.eagle_model import EagleDrafter
from specops.models.runner import prompt_forward
from specops.spec.sampling import SamplingConfig
from specops.engine.engine import Engine
from specops.engine.sequence import SamplingParams, SpecSettings
from tests.decoder.test_distribution import ALPHA, STEPS, TINY_V, _exact_joint, chi_square_pvalue
from tests.decoder.test_eagle import bundled_setup
from tests.decoder.tiny_models import tiny_llama
from tests.serving.test_engine import check_exact, full_speculation
from tests.serving.test_engine_memory import check_blocks


@pytest.fixture(scope="module")
def bundled():
    return bundled_setup()  # (model, tokenizer, training prompts, held-out prompts, trained drafter)


@pytest.fixture(scope="module")
def dec(bundled):
    model, tok, _, _, drafter = bundled
    return Decoder(model, eagle=drafter, tokenizer=tok)


def _short_drafter(bundled, context: int) -> EagleDrafter:
    """The trained drafter with a context of ``context`` positions."""
    model, _, _, _, drafter = bundled
    small = EagleDrafter(dataclasses.replace(drafter.config, max_position_embeddings=context))
    small.load_state_dict(drafter.state_dict())
    return small.bind(model).eval()


def _run(eng: Engine, requests) -> tuple[dict[str, list[int]], dict[str, object]]:
    for rid, prompt, params, spec in requests:
        eng.add(rid, prompt, params, spec)
    got: dict[str, list[int]] = {}
    records: dict[str, object] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                records[out.request_id] = out.record
    return got, records


def test_greedy_eagle_alone_equals_plain_decoding(bundled, dec):
    prompts = bundled[2][:2] + bundled[3][:2]
    eng = full_speculation(Engine(dec, max_batch=1, kv_cache_mb=8))
    assert "eagle" in eng.speculative_methods
    accepted = 0
    for i, prompt in enumerate(prompts):
        want = dec.generate(prompt, method="ar", max_new_tokens=40, eos_token_id=1).tokens
        got, records = _run(eng, [(f"e{i}", prompt, SamplingParams(max_tokens=40), SpecSettings(method="eagle"))])
        rec = records[f"e{i}"]
        assert got[f"e{i}"] == want, i
        assert rec.method == "eagle" and rec.drafted > 0 and rec.fallback_reason is None
        assert rec.to_record("c").planned
        accepted += rec.accepted
    assert accepted > 40  # drafts were accepted: the drafter's state is right, not only the output
    assert eng.stats().kv_blocks_used == 0


def test_greedy_eagle_in_a_mixed_batch_equals_plain_decoding(bundled, dec):
    prompts = bundled[3][:4] + bundled[2][:5]
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=8))
    records = check_exact(dec, eng, prompts, max_tokens=32, eos=1, methods=("ar", "ngram", "eagle"),
                          need_accept=False)
    eagle = [r for r in records.values() if r.method == "eagle"]
    assert len(eagle) == 3 and sum(r.accepted for r in eagle) > 10


def test_preempted_eagle_sequences_rebuild_their_drafter_cache_and_stay_exact(bundled, dec):
    prompts = [p[:30] for p in bundled[2][:6]]
    # ~128 token slots: two or three of the six sequences (up to 70 tokens each) at a time
    eng = full_speculation(Engine(dec, max_batch=6, kv_cache_mb=1.0, block_size=8, calibrate=False,
                                  eos_token_id=None))
    assert eng.pool.capacity_slots < 3 * 70
    want = {f"e{i}": dec.generate(p, method="ar", max_new_tokens=40).tokens for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        eng.add(f"e{i}", p, SamplingParams(max_tokens=40), SpecSettings(method="eagle", gamma=3))
    got: dict[str, list[int]] = {}
    records = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                records[out.request_id] = out.record
        check_blocks(eng)
        for seq in eng.seqs.values():  # a preempted sequence's drafter state goes with its blocks
            assert seq.target.blocks or (seq.eagle.cursor.cache is None and seq.eagle.cursor.unfed == 0)
    assert eng.stats().preemptions > 0  # the budget really overflowed
    assert got == want
    assert sum(r.accepted for r in records.values()) > 0


def test_past_the_deadline_eagle_decodes_plainly_and_frees_its_drafter_state(bundled, dec):
    now = [0.0]
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, clock=lambda: now[0], eos_token_id=None))
    prompt = bundled[2][0]
    want = dec.generate(prompt, method="ar", max_new_tokens=40).tokens
    eng.add("d", prompt, SamplingParams(max_tokens=40), SpecSettings(method="eagle", deadline_s=1.0))
    got, drafted_at_deadline, seq = [], None, eng.seqs["d"]
    while eng.has_unfinished():
        if len(got) >= 12 and drafted_at_deadline is None:
            now[0] = 2.0  # past the deadline
            drafted_at_deadline = seq.stats.drafted
        for out in eng.step():
            got.extend(out.new_token_ids)
            record = out.record
        if drafted_at_deadline is not None and eng.has_unfinished():
            assert not seq.eagle.active and seq.eagle.cursor.cache is None and seq.eagle.cursor.waiting == []
    assert got == want
    assert record.fallback_reason == "deadline"
    assert 0 < drafted_at_deadline == record.drafted  # it speculated, then nothing past the deadline


def test_auto_chooses_eagle_among_the_loaded_methods(bundled, dec):
    eng = full_speculation(Engine(dec, max_batch=4, kv_cache_mb=8, eos_token_id=None))
    assert eng.speculative_methods == ("ngram", "eagle")
    prompts = bundled[2][:4]
    got, records = _run(eng, [(f"a{i}", p, SamplingParams(max_tokens=16), SpecSettings(method="auto"))
                              for i, p in enumerate(prompts)])
    assert {r.method for r in records.values()} == {"ngram", "eagle"}  # untried methods go round first
    for i, p in enumerate(prompts):
        assert got[f"a{i}"] == dec.generate(p, method="ar", max_new_tokens=16).tokens


def test_engine_drafter_cache_equals_the_library_state(bundled, dec):
    """After some engine steps, a sequence's drafter cache holds the entries the library's holds for
    the same tokens (real features of positions 0 .. N-2), and it drafts the library's chain."""
    model, _, prompts, _, drafter = bundled
    drafter.kernel_weights = "fp32"  # one sequence fed step by step against one fed at once: fp32 rounding only
    try:
        _check_engine_cache_equals_the_library_state(dec, prompts, drafter)
    finally:
        drafter.kernel_weights = "bf16"


def _check_engine_cache_equals_the_library_state(dec, prompts, drafter):
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8))
    eng.add("a", prompts[1], SamplingParams(max_tokens=60), SpecSettings(method="eagle", gamma=4))
    eng.add("b", prompts[2], SamplingParams(max_tokens=60), SpecSettings(method="ngram", gamma=4))
    for _ in range(6):
        eng.step()
    seq = eng.seqs["a"]
    assert seq.eagle.cursor.cache is not None and eng.eagle.ready(seq) and seq.num_output > 6
    drafted, _ = eng.eagle.propose(seq, 5)
    n = len(seq.tokens)
    assert seq.eagle.cursor.cache.length == n - 1 and seq.eagle.cursor.unfed == 0
    # the library's state: features of x_0 .. x_{N-2} from the target's own prompt pass
    with torch.no_grad():
        dec.target.reset(1)
        feats = prompt_forward(dec.target, torch.tensor([seq.tokens[:-1]]), logits=False, need_hidden=True).hidden[0]
        drafter.reset()
        last = drafter.step(torch.tensor(seq.tokens[1:]), feats)[-1]
        want, _ = draft_chain(drafter, last, 5, SamplingConfig(), torch.Generator(), drafter.config.vocab_size,
                               torch.device("cpu"))
    assert drafted == want
    mine = seq.eagle.cursor.cache.data[..., : n - 1, :]
    theirs = drafter._cache.data[..., : n - 1, :]
    torch.testing.assert_close(mine, theirs, atol=2e-4, rtol=2e-4)


def test_a_sequence_outgrowing_the_drafter_decodes_plainly_and_exactly(bundled):
    model, tok, prompts, _, _ = bundled
    dec = Decoder(model, eagle=_short_drafter(bundled, 48), tokenizer=tok)
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, eos_token_id=None))
    long_prompt = prompts[0][:60]  # longer than the drafter's context from the start
    mid = prompts[1][:24]  # speculates, then crosses the context mid-request
    want = {"long": dec.generate(long_prompt, method="ar", max_new_tokens=30).tokens,
            "mid": dec.generate(mid, method="ar", max_new_tokens=40).tokens}
    got, records = _run(eng, [("long", long_prompt, SamplingParams(max_tokens=30), SpecSettings(method="eagle")),
                              ("mid", mid, SamplingParams(max_tokens=40), SpecSettings(method="eagle"))])
    assert got == want
    assert records["long"].fallback_reason == "draft_context" and records["long"].drafted == 0
    assert records["mid"].fallback_reason == "draft_context" and records["mid"].drafted > 0


def test_sampled_eagle_repeats_itself_with_a_seed(bundled, dec):
    prompt = bundled[3][0]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, eos_token_id=None))
        got, records = _run(eng, [("s", prompt, params, SpecSettings(method="eagle")),
                                  ("n", bundled[3][1], SamplingParams(max_tokens=24, temperature=1.0, seed=3),
                                   SpecSettings(method="ngram"))])
        assert records["s"].drafted > 0 and len(got["s"]) == 24
        runs.append(got)
    assert runs[0] == runs[1]


def _sample_counts(target, drafter, n: int) -> tuple[torch.Tensor, int, int]:
    """Joint counts of the first STEPS tokens of ``n`` seeded eagle requests 16 at a time; drafted, accepted."""
    eng = full_speculation(Engine(Decoder(target, eagle=drafter), max_batch=16, kv_cache_mb=1, calibrate=False,
                                  eos_token_id=None))
    for i in range(n):
        eng.add(f"r{i}", SAMPLED_PROMPT, SamplingParams(max_tokens=STEPS, temperature=1.0, seed=i),
                SpecSettings(method="eagle", gamma=2))
    got, records = _run(eng, [])
    counts = torch.zeros(TINY_V**STEPS, dtype=torch.long)
    for toks in got.values():
        counts[int("".join(map(str, toks)), TINY_V)] += 1
    return counts, sum(r.drafted for r in records.values()), sum(r.accepted for r in records.values())


SAMPLED_PROMPT = [1, 2, 3, 1, 2]


def test_sampled_eagle_follows_the_target_distribution(monkeypatch):
    torch.set_num_threads(1)
    target = tiny_llama(seed=3, vocab=TINY_V, hidden=32, init_range=0.3)
    drafter = EagleDrafter.for_target(target, seed=2, shortlist=[0, 1, 3])  # q is 0 on token 2
    exact = _exact_joint(target, SAMPLED_PROMPT, SamplingConfig(temperature=1.0))
    n = 1200
    counts, drafted, accepted = _sample_counts(target, drafter, n)
    assert drafted > n // 2 and accepted > n // 10  # speculation really ran and was accepted
    assert chi_square_pvalue(counts, exact) > ALPHA
    # the check's power: drafts verified against the wrong q (uniform) are caught
    real = eagle_module.draft_chain

    def uniform_q(*args, **kwargs):
        tokens, q = real(*args, **kwargs)
        return tokens, torch.full_like(q, 1.0 / q.shape[-1])

    monkeypatch.setattr(eagle_module, "draft_chain", uniform_q)
    counts, _, _ = _sample_counts(target, drafter, n)
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_abort_mid_request_frees_the_drafter_state(bundled, dec):
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, calibrate=False))
    eng.add("a", bundled[3][0], SamplingParams(max_tokens=60), SpecSettings(method="eagle"))
    eng.add("b", bundled[3][1], SamplingParams(max_tokens=20), SpecSettings(method="eagle"))
    for _ in range(5):
        eng.step()
    victim = eng.seqs["a"]
    assert victim.eagle.cursor.cache is not None and victim.eagle.cursor.cache.length > 0
    eng.abort("a")
    outs = eng.step()
    assert [o.finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    assert "a" not in eng.seqs and victim.target.blocks == []
    cursor = victim.eagle.cursor
    assert cursor.cache is None and cursor.waiting == [] and cursor.unfed == 0
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kv_blocks_used == 0


def test_an_engine_without_a_drafter_refuses_eagle(bundled):
    model, tok, prompts, _, _ = bundled
    eng = Engine(Decoder(model, tokenizer=tok), max_batch=2, kv_cache_mb=8, calibrate=False)
    assert "eagle" not in eng.speculative_methods
    with pytest.raises(ValueError, match="method 'eagle' needs an EAGLE drafter"):
        eng.add("x", prompts[0], SamplingParams(max_tokens=4), SpecSettings(method="eagle"))
    assert not eng.has_unfinished()
    eng.add("y", prompts[0], SamplingParams(max_tokens=4), SpecSettings(method="auto"))  # auto never picks it
    got, records = _run(eng, [])
    assert len(got["y"]) == 4 and records["y"].method != "eagle"


def test_a_policy_class_naming_eagle_runs_plainly_without_a_drafter(bundled, dec):
    from specops.policies.schema import Policy
    from specops.engine.policy_runtime import REASON_MISSING, PolicyRuntime

    model, tok, prompts, _, _ = bundled
    policy = Policy.model_validate({"version": 1, "default_class": "chat",
                                    "classes": [{"name": "chat", "method": "eagle", "gamma": {"initial": 3,
                                                                                            "min": 1, "max": 6}}]})
    plain = PolicyRuntime(Decoder(model, tokenizer=tok), policy).resolve("hi", 1)
    assert (plain.method, plain.fallback_reason) == ("ar", REASON_MISSING)
    runtime = PolicyRuntime(dec, policy)
    res = runtime.resolve("hi", 1)
    assert (res.method, res.gamma, res.fallback_reason) == ("eagle", 3, None)
    assert res.as_dict()["gamma"] == 3
    served = runtime.serve(prompts[0], max_new_tokens=12)
    assert served.method == "eagle" and served.stats.drafted > 0
    assert served.tokens == dec.generate(prompts[0], method="ar", max_new_tokens=12).tokens


def test_serve_eagle_option_reaches_the_decoder(bundled, tmp_path, monkeypatch):
    """`specops serve --eagle PATH` loads the drafter with the target (`Decoder.from_pretrained(...,
    eagle=PATH)`), and the engine built on that decoder offers method eagle."""
    from click.testing import CliRunner

    import specops.server.server as server
    from specops.models.eagle_io import save_drafter
    from specops.server.cli import serve_command

    save_drafter(bundled[4], tmp_path / "eagle")
    configs = []
    monkeypatch.setattr(server, "run_server", configs.append)
    interval = sys.getswitchinterval()  # the command sets the process's (`GIL_SWITCH_INTERVAL_S`)
    try:
        result = CliRunner().invoke(serve_command, ["--port", "0", "--eagle", str(tmp_path / "eagle")])
        bad = CliRunner().invoke(serve_command, ["--port", "0", "--eagle", str(tmp_path / "missing")])
    finally:
        sys.setswitchinterval(interval)
    assert result.exit_code == 0, result.output
    assert configs[0].eagle == str(tmp_path / "eagle")
    assert bad.exit_code == 2 and "--eagle" in bad.output

    loaded = {}

    class Stop(Exception):
        pass

    def from_pretrained(path, **kwargs):
        loaded.update(kwargs, path=path)
        raise Stop

    monkeypatch.setattr(Decoder, "from_pretrained", from_pretrained)
    with pytest.raises(Stop):
        server.build_engine_client(configs[0], None, None, None)
    assert loaded["eagle"] == str(tmp_path / "eagle") and loaded["path"] == "bundled"
    monkeypatch.undo()
    eng = Engine(Decoder.from_pretrained("bundled", eagle=tmp_path / "eagle"), max_batch=2, kv_cache_mb=8,
                 calibrate=False)
    assert eng.speculative_methods[-1] == "eagle"


def test_hidden_only_rows_skip_the_lm_head_and_keep_every_bit(dec):
    """An EAGLE prompt pass needs every row's hidden state and only the last row's logits
    (`FeedItem.hidden_only`): in a batch beside a plain item, the C stack returns the same hidden
    rows and the same logits of the rows that need them, bit for bit, as a pass that computes
    logits for every row, and the logits of those rows alone."""
    from specops.engine.batch_forward import FeedItem, PagedBackend
    from specops.engine.kv_pool import BlockPool
    from specops.engine.sequence import SeqKV

    runner = dec.target
    prompt, other = list(range(5, 45)), list(range(50, 59))
    outs = {}
    for skip in (False, True):
        backend = PagedBackend(runner, BlockPool(8, 16))
        assert backend.model.c_layers  # the C stack is what skips the head
        items = [FeedItem(kv=SeqKV(blocks=[0, 1, 2]), tokens=prompt, rows=list(range(len(prompt))),
                          hidden_only=len(prompt) - 1 if skip else 0),
                 FeedItem(kv=SeqKV(blocks=[4]), tokens=other, rows=[len(other) - 1])]
        outs[skip] = backend.forward(items, need_hidden=True)
    full, lean = outs[False], outs[True]
    assert lean[0].logits.shape[0] == 1 and full[0].logits.shape[0] == len(prompt)
    assert torch.equal(lean[0].hidden, full[0].hidden)
    assert torch.equal(lean[0].logits[0], full[0].logits[-1])
    assert torch.equal(lean[1].logits, full[1].logits) and torch.equal(lean[1].hidden, full[1].hidden)
    assert lean[1].step_logits[lean[1].row0].equal(full[1].logits[0])  # the step's rows line up


def _prefix_cached(dec, first_method: str, prompt, max_tokens: int = 24):
    """An engine that ran ``prompt`` with ``first_method`` to its end, then runs it with eagle:
    (blocks the eagle request reused, its record, its tokens, plain decoding's tokens, the engine)."""
    eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, block_size=8, eos_token_id=None))
    want = dec.generate(prompt, method="ar", max_new_tokens=max_tokens).tokens
    got, _ = _run(eng, [("a", prompt, SamplingParams(max_tokens=max_tokens), SpecSettings(method=first_method))])
    assert got["a"] == want
    hits = eng.pool.cache_hits
    got, records = _run(eng, [("b", prompt, SamplingParams(max_tokens=max_tokens), SpecSettings(method="eagle"))])
    return eng.pool.cache_hits - hits, records["b"], got["b"], want, eng


def test_an_eagle_request_reuses_the_prompt_blocks_an_eagle_request_cached(bundled, dec):
    """The hidden rows of the blocks an eagle sequence publishes are kept beside them, so a later
    eagle request reuses its cached prompt (not only ar / n-gram ones) and drafts from exactly the
    state a full prefill gives it."""
    prompt = bundled[2][3][:45]
    reused, rec, got, want, eng = _prefix_cached(dec, "eagle", prompt)
    assert reused == (len(prompt) - 1) // 8  # every full block but the one holding the last token
    assert got == want and rec.drafted > 0 and rec.accepted > 0 and rec.fallback_reason is None
    assert 0 < len(eng.eagle.features) <= eng.pool.num_blocks


def test_a_reused_prompts_kept_rows_give_the_drafter_the_state_of_a_full_prefill(bundled, dec):
    model, _, prompts, _, drafter = bundled
    drafter.kernel_weights = "fp32"  # rows from two forwards of different shapes: fp32 rounding only
    try:
        prompt = prompts[4][:41]
        eng = full_speculation(Engine(dec, max_batch=1, kv_cache_mb=8, block_size=8, eos_token_id=None))
        _run(eng, [("a", prompt, SamplingParams(max_tokens=8), SpecSettings(method="eagle"))])
        eng.add("b", prompt, SamplingParams(max_tokens=8), SpecSettings(method="eagle", gamma=3))
        hits = eng.pool.cache_hits
        eng.step()  # the prefill of the blocks not cached, the reused rows fed first
        assert eng.pool.cache_hits - hits == 5
        seq = eng.seqs["b"]
        assert seq.eagle.cursor.known == len(seq.tokens) - 1
        eng.eagle.propose(seq, 1)  # catch up: every entry fed
        n = len(seq.tokens)
        with torch.no_grad():
            dec.target.reset(1)
            feats = prompt_forward(dec.target, torch.tensor([seq.tokens[:-1]]), logits=False,
                                   need_hidden=True).hidden[0]
            drafter.reset()
            drafter.step(torch.tensor(seq.tokens[1:]), feats)
        torch.testing.assert_close(seq.eagle.cursor.cache.data[..., : n - 1, :], drafter._cache.data[..., : n - 1, :],
                                   atol=2e-4, rtol=2e-4)
    finally:
        drafter.kernel_weights = "bf16"


def test_an_eagle_request_computes_the_blocks_other_methods_cached(bundled, dec):
    """Blocks an ar request published carry no hidden rows: an eagle request computes its whole
    prompt (and drafts, exactly) rather than reuse them."""
    prompt = bundled[2][3][:45]
    reused, rec, got, want, _ = _prefix_cached(dec, "ar", prompt)
    assert reused == 0
    assert got == want and rec.drafted > 0 and rec.fallback_reason is None


def test_eagle_requests_admitted_together_wait_for_one_anothers_blocks_not_for_blocks_without_rows(bundled, dec):
    """Cold cache, requests with one prompt admitted at once: an eagle request behind another
    eagle request waits a step and reuses its blocks, published with their hidden rows; behind an
    ar request (blocks without rows, which it could never reuse) it does not wait. Every output
    is plain greedy decoding's."""
    prompt = bundled[2][3][:45]
    want = dec.generate(prompt, method="ar", max_new_tokens=16).tokens
    for first, waits in (("eagle", True), ("ar", False)):
        eng = full_speculation(Engine(dec, max_batch=2, kv_cache_mb=8, block_size=8, eos_token_id=None))
        hits = eng.pool.cache_hits
        got, records = _run(eng, [(rid, prompt, SamplingParams(max_tokens=16), SpecSettings(method=method))
                                  for rid, method in (("a", first), ("b", "eagle"))])
        assert got == {"a": want, "b": want}, first
        assert eng.stats().prefix_deferrals == (1 if waits else 0), first
        assert eng.pool.cache_hits - hits == ((len(prompt) - 1) // 8 if waits else 0), first
        assert records["b"].drafted > 0 and records["b"].fallback_reason is None
        check_blocks(eng)
