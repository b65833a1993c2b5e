"""Tree masks, positions and malformed-tree rejection."""

from __future__ import annotations

import math

import pytest
import torch

from specpair.runtime.tree import (
    CandidateTree,
    MalformedTreeError,
    chain,
    check_sparse_q,
    full_parents,
    sparse_q_faults,
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
        # chains take a fast path: its faults still name the node
        (chain([3, 10]), r"node 1: token 10 outside the vocabulary \[0, 10\)"),
        (chain([-3, 2]), "node 0: token -3 outside"),
        (CandidateTree((1,), (-1,), torch.zeros(2, 10)), "draft_probs shape"),
    ],
)
def test_malformed_trees_are_rejected(tree: CandidateTree, message: str) -> None:
    with pytest.raises(MalformedTreeError, match=message):
        validate_tree(tree, max_nodes=8, max_depth=4, vocab_size=10)


def test_valid_tree_depths() -> None:
    tree = CandidateTree((1, 2, 3, 4), (-1, 0, 0, 1))
    assert validate_tree(tree, max_nodes=8, max_depth=4, vocab_size=10) == [1, 2, 2, 3]
    assert validate_tree(chain([9, 0, 5]), max_nodes=8, max_depth=4, vocab_size=10) == [1, 2, 3]
    assert validate_tree(chain([]), max_nodes=8, max_depth=4, vocab_size=10) == []


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


def _sparse_tree(gen: torch.Generator, n: int, k: int, vocab: int, fault: int) -> CandidateTree:
    """A chain of n nodes with a sparse q of k ids each, honest or broken one way (`fault`)."""
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(n)])
    q = torch.softmax(torch.randn(n, k, generator=gen), -1)
    tokens = ids[:, 0].clone()
    row = int(torch.randint(n, (1,), generator=gen))
    if fault == 1:
        ids[row, 1] = vocab  # outside the vocabulary
    elif fault == 2:
        ids[row, 1] = ids[row, 0]  # a repeated id
    elif fault == 3:
        q[row, 1] = math.nan
    elif fault == 4:
        q[row, 1], q[row, 2] = -q[row, 1], q[row, 2] + 2 * q[row, 1]  # still sums to 1
    elif fault == 5:
        q[row] *= 0.9
    elif fault == 6:
        q[row, 1] += q[row, 0]
        q[row, 0] = 0  # the drafted token without mass
    elif fault == 7:
        tokens[row] = int(ids[row].max()) + 1 if int(ids[row].max()) + 1 < vocab else 0
        if int(tokens[row]) in ids[row].tolist():
            tokens[row] = -1  # not among its ids at all
    elif fault == 8:
        q = q[:, :-1]  # a shape that does not match the ids
    elif fault == 9:
        ids = ids.float()  # not integer ids
    elif fault == 10:
        return CandidateTree(tuple(tokens.tolist()), tuple(range(-1, n - 1)), None, ids.int())
    dtype = torch.int64 if fault == 11 else torch.int32
    probs = q.half() if fault == 12 else q
    return CandidateTree(
        tuple(tokens.tolist()),
        tuple(range(-1, n - 1)),
        probs,
        ids.to(dtype) if not ids.dtype.is_floating_point else ids,
    )


def _alone(tree: CandidateTree, vocab: int) -> str | None:
    if tree.draft_ids is None:
        return None
    try:
        check_sparse_q(tree, vocab)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_rounds_sparse_qs_checked_at_once_fault_as_each_alone() -> None:
    """The batched check names the same fault (or none) for every tree as checking it alone,
    whatever the other trees of the round: every kind of broken q, other widths (k), no q,
    int64 ids, half-precision q."""
    gen = torch.Generator().manual_seed(0)
    vocab, seen = 40, set()
    for _ in range(300):
        trees = []
        for _ in range(int(torch.randint(1, 9, (1,), generator=gen))):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            k = 6 if torch.rand(1, generator=gen) < 0.8 else 5
            fault = (
                int(torch.randint(0, 13, (1,), generator=gen))
                if torch.rand(1, generator=gen) < 0.4
                else 0
            )
            trees.append(_sparse_tree(gen, n, k, vocab, fault))
            trees += [chain([1, 2])] if fault == 0 and n == 1 else []  # no q at all
        expected = [_alone(t, vocab) for t in trees]
        assert sparse_q_faults(trees, vocab) == expected
        seen |= {e.split(":")[0] if e else None for e in expected}
    assert len(seen) >= 8, seen  # honest trees and most kinds of fault were drawn
