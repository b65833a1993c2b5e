"""Greedy and sampling acceptance as pure functions."""

from __future__ import annotations

import pytest
import torch

from specpair.runtime.accept import accept_greedy, accept_sampling
from specpair.runtime.tree import CandidateTree, chain


def one_hot_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_chain_stops_at_first_mismatch() -> None:
    tree = chain([4, 5, 6])
    # the target predicts 4 after the root, 5 after node 0, 9 after node 1 (draft said 6)
    acc = accept_greedy(tree, one_hot_logits([4, 5, 9, 1]))
    assert acc.tokens == (4, 5) and acc.nodes == (0, 1) and acc.bonus == 9
    assert acc.accept_length == 2 and acc.keep == [0, 1, 2]


def test_greedy_all_accepted_takes_bonus_after_last() -> None:
    acc = accept_greedy(chain([4, 5]), one_hot_logits([4, 5, 7]))
    assert acc.tokens == (4, 5) and acc.bonus == 7


def test_greedy_empty_tree_is_plain_decoding() -> None:
    acc = accept_greedy(CandidateTree((), ()), one_hot_logits([3]))
    assert acc.tokens == () and acc.bonus == 3 and acc.keep == [0]


def test_greedy_tree_follows_the_matching_branch() -> None:
    # root → {a=1, b=2}; b → {c=3}; full indices: root 0, a 1, b 2, c 3
    tree = CandidateTree((1, 2, 3), (-1, -1, 1))
    acc = accept_greedy(tree, one_hot_logits([2, 0, 3, 8]))
    assert acc.nodes == (1, 2) and acc.tokens == (2, 3) and acc.bonus == 8
    assert acc.keep == [0, 2, 3]  # non-contiguous in the full tree


def test_sampling_needs_draft_probs() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampling(chain([1]), torch.full((2, 4), 0.25), None)


def test_sampling_accepts_when_q_equals_p_and_rejects_impossible_tokens() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    same = accept_sampling(chain([1], p[None].clone()), torch.stack([p, p]), gen)
    assert same.tokens == (1,)
    q = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rejected = accept_sampling(chain([2], q[None]), torch.stack([p, p]), gen)
    # p(2) = 0: always rejected; the residual (p - q)+ is p itself
    assert rejected.tokens == () and rejected.bonus in (0, 1)
