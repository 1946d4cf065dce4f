"""Decoding rules (`lti.decoding`) against a brute-force reference."""

import itertools

import pytest
import torch

from lti.decoding import decode, distinct_slots


def _brute_force(logits, m):
    updates, positions, vocab = logits.shape
    length = positions // m
    slots = logits.view(updates, m, length, vocab)
    best = torch.empty(updates, m, length, dtype=torch.long)
    for u in range(updates):
        for p in range(length):
            choice = max(itertools.permutations(range(vocab), m),
                         key=lambda tokens: sum(float(slots[u, i, p, t]) for i, t in enumerate(tokens)))
            best[u, :, p] = torch.tensor(choice)
    return best.view(updates, positions)


@pytest.mark.parametrize("m", [2, 3])
def test_distinct_slots_is_the_best_assignment_of_distinct_tokens(m):
    torch.manual_seed(m)
    logits = torch.randn(3, m * 4, 7)
    logits[:, :, 2] += 3.0  # one token every slot likes: argmax would repeat it
    fast = distinct_slots(logits, m)
    reference = _brute_force(logits, m)
    slots_fast = fast.view(3, m, 4)
    score = lambda ids: logits.gather(-1, ids[..., None]).sum()  # noqa: E731
    assert torch.isclose(score(fast), score(reference))
    for u in range(3):
        for p in range(4):
            assert len(set(slots_fast[u, :, p].tolist())) == m  # distinct tokens per position
    assert not torch.equal(fast, logits.argmax(-1))  # the repeated favourite was not kept in every slot


def test_one_sequence_and_argmax_are_the_plain_argmax():
    logits = torch.randn(2, 8, 5)
    assert torch.equal(distinct_slots(logits, 1), logits.argmax(-1))
    assert torch.equal(decode(logits, 2, "argmax"), logits.argmax(-1))
    with pytest.raises(ValueError, match="decoding 'beam'"):
        decode(logits, 2, "beam")
