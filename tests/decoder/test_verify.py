"""Acceptance rules on hand-made blocks: greedy prefix matching and rejection sampling cases."""

from __future__ import annotations

import pytest
import torch

from specops.spec.verify import verify_greedy, verify_sampling


def _logits_with_argmax(choices: list[int], vocab: int = 6) -> torch.Tensor:  # -> [1, G+1, V]
    logits = torch.zeros(1, len(choices), vocab)
    for i, c in enumerate(choices):
        logits[0, i, c] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft, target_choice, accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus token = argmax after the last
        ([1, 2, 3], [5, 2, 3, 4], 0, 5),  # rejected at the first position
        ([1, 2, 3], [1, 2, 0, 4], 2, 0),  # rejected at the last position
        ([1, 2, 3], [1, 0, 3, 4], 1, 0),  # a later match after a rejection does not count
        ([], [4], 0, 4),  # nothing drafted: a plain step
    ],
)
def test_greedy_accepts_the_matching_prefix(draft, target_choice, accepted, next_token):
    res = verify_greedy(torch.tensor([draft], dtype=torch.long).reshape(1, -1), _logits_with_argmax(target_choice))
    assert res.accepted.tolist() == [accepted]
    assert res.next_tokens.tolist() == [next_token]


def test_greedy_is_batched_row_by_row():
    draft = torch.tensor([[1, 2], [1, 2]])
    logits = torch.cat([_logits_with_argmax([1, 2, 3]), _logits_with_argmax([0, 2, 3])])  # [2, 3, V]
    res = verify_greedy(draft, logits)
    assert res.accepted.tolist() == [2, 0]
    assert res.next_tokens.tolist() == [3, 0]


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"\[B, G\+1, V\]"):
        verify_greedy(torch.tensor([[1, 2]]), torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(torch.tensor([[1]]), torch.full((1, 2, 4), 0.25), torch.full((1, 2, 4), 0.25), torch.Generator())


def _one_hot_rows(tokens: list[int], vocab: int) -> torch.Tensor:  # -> [1, G, V]
    return torch.nn.functional.one_hot(torch.tensor([tokens]), vocab).float()


def test_identical_distributions_always_accept_and_draw_the_bonus_from_p():
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    q = torch.softmax(torch.randn(1, 3, vocab, generator=gen), -1)  # [1, 3, V]
    p_last = torch.tensor([[[0.0, 0.0, 0.0, 1.0, 0.0]]])  # bonus distribution: always token 3
    p = torch.cat([q, p_last], dim=1)  # [1, 4, V]
    for _ in range(50):
        draft = torch.multinomial(q[0], 1, generator=gen).T  # [1, 3]
        res = verify_sampling(draft, p, q, gen)
        assert res.accepted.tolist() == [3]
        assert res.next_tokens.tolist() == [3]


def test_disjoint_supports_always_reject_and_recover_from_p():
    gen = torch.Generator().manual_seed(1)
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])  # [1, 1, V]
    p = torch.tensor([[[0.0, 0.0, 0.3, 0.7], [0.25, 0.25, 0.25, 0.25]]])  # [1, 2, V]
    seen = set()
    for _ in range(200):
        draft = torch.multinomial(q[0], 1, generator=gen).T
        res = verify_sampling(draft, p, q, gen)
        assert res.accepted.tolist() == [0]
        seen.add(int(res.next_tokens[0]))
    assert seen == {2, 3}


def test_point_mass_draft_is_rejected_where_target_gives_zero_probability():
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([[[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]]])  # [1, 2, 3]
    for _ in range(50):
        res = verify_sampling(torch.tensor([[0]]), p, None, gen)  # deterministic drafter proposes 0
        assert res.accepted.tolist() == [0]
        assert int(res.next_tokens[0]) in (1, 2)


def test_point_mass_draft_equals_explicit_one_hot_draft():
    p = torch.softmax(torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(3)), -1)
    draft = torch.tensor([[2, 5, 1]])
    a = verify_sampling(draft, p, None, torch.Generator().manual_seed(9))
    b = verify_sampling(draft, p, _one_hot_rows([2, 5, 1], 7), torch.Generator().manual_seed(9))
    assert a.accepted.tolist() == b.accepted.tolist()
    assert a.next_tokens.tolist() == b.next_tokens.tolist()


def test_seeded_verification_is_reproducible():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(1, 5, 9, generator=g), -1)
    q = torch.softmax(torch.randn(1, 4, 9, generator=g), -1)
    draft = torch.tensor([[0, 1, 2, 3]])
    runs = [verify_sampling(draft, p, q, torch.Generator().manual_seed(11)) for _ in range(2)]
    assert runs[0].accepted.tolist() == runs[1].accepted.tolist()
    assert runs[0].next_tokens.tolist() == runs[1].next_tokens.tolist()


def test_one_commit_rule_cuts_after_eos_and_voids_drafts_past_an_accepted_one():
    from specops.spec.speculation import step_tokens

    eos = frozenset({9})
    plain = step_tokens([1, 2], 3, drafted=4, eos=eos)
    assert (plain.emitted, plain.drafted, plain.accepted, plain.raw_accepted) == ([1, 2, 3], 4, 2, 2)
    inside = step_tokens([1, 9, 2], 3, drafted=4, eos=eos)  # EOS is the second accepted draft
    assert (inside.emitted, inside.drafted, inside.accepted, inside.raw_accepted) == ([1, 9], 2, 2, 3)
    last = step_tokens([1, 2], 9, drafted=2, eos=eos)  # EOS as the bonus token: nothing voided
    assert (last.emitted, last.drafted, last.accepted) == ([1, 2, 9], 2, 2)
    assert step_tokens([9], 4, drafted=1, eos=frozenset()).emitted == [9, 4]  # no EOS set: never stops
