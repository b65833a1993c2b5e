"""Tree masks, positions and malformed-tree rejection."""

from __future__ import annotations

import math

import pytest
import torch

from specpair.runtime.tree import (
    CandidateTree,
    MalformedTreeError,
    chain,
    full_parents,
    tree_mask,
    tree_positions,
    validate_tree,
)


def test_tree_mask_sees_ancestors_only() -> None:
    # root, a (child of root), b and c (children of a), d (child of b)
    parents = full_parents(CandidateTree((1, 2, 3, 4), (-1, 0, 0, 1)))
    assert parents == [-1, 0, 1, 1, 2]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_mask(parents), expected)
    assert tree_positions(7, parents).tolist() == [7, 8, 9, 9, 10]


def test_chain_is_lower_triangular() -> None:
    tree = chain([5, 6, 7])
    assert tree.is_chain() and tree.parents == (-1, 0, 1)
    assert torch.equal(tree_mask(full_parents(tree)), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (CandidateTree((1, 2), (-1, 1)), "parent 1 must be -1 or an earlier node"),
        (CandidateTree((1, 2), (1, 0)), "parent 1 must be -1 or an earlier node"),
        (CandidateTree((1, 2), (-1, -2)), "parent -2"),
        (CandidateTree((1, 2), (-1,)), "2 tokens but 1 parents"),
        (CandidateTree((1, 999), (-1, 0)), "outside the vocabulary"),
        (CandidateTree((1, -1), (-1, 0)), "outside the vocabulary"),
        (chain(range(9)), "9 nodes, more than the limit 8"),
        (chain([1, 2, 3, 4, 5]), "depth 5 exceeds the limit 4"),
        (CandidateTree((1,), (-1,), torch.zeros(2, 10)), "draft_probs shape"),
    ],
)
def test_malformed_trees_are_rejected(tree: CandidateTree, message: str) -> None:
    with pytest.raises(MalformedTreeError, match=message):
        validate_tree(tree, max_nodes=8, max_depth=4, vocab_size=10)


def test_valid_tree_depths() -> None:
    tree = CandidateTree((1, 2, 3, 4), (-1, 0, 0, 1))
    assert validate_tree(tree, max_nodes=8, max_depth=4, vocab_size=10) == [1, 2, 2, 3]


def _probs(rows: list[list[float]]) -> torch.Tensor:
    """[n, 10] rows: each given prefix, zeros after."""
    out = torch.zeros(len(rows), 10)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


@pytest.mark.parametrize(
    ("probs", "message"),
    [
        (torch.zeros(2, 10), r"draft_probs\[0\]: sums to 0"),
        (_probs([[0, 0.5, 0.5], [0, 0, 1.5, -0.5]]), "negative"),
        (_probs([[0, 1], [math.nan, 0, 1]]), "NaN or infinite"),
        (_probs([[0, 1], [0, 0, math.inf]]), "NaN or infinite"),
        (_probs([[0, 1], [0, 0, 0.9]]), r"draft_probs\[1\]: sums to 0.9"),
        (_probs([[0, 1], [0, 0, 0, 1]]), r"draft_probs\[1\]: its drafted token has probability 0"),
    ],
)
def test_draft_probs_that_rejection_sampling_cannot_trust_are_refused(
    probs: torch.Tensor, message: str
) -> None:
    tree = chain([1, 2], probs)  # node 0 drafted token 1, node 1 token 2
    with pytest.raises(MalformedTreeError, match=message):
        validate_tree(tree, max_nodes=8, max_depth=4, vocab_size=10)


def test_honest_draft_probs_pass() -> None:
    probs = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(0)), -1)
    assert validate_tree(chain([1, 2], probs), max_nodes=8, max_depth=4, vocab_size=10) == [1, 2]
