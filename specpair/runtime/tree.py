"""Candidate trees: draft token ids plus a parent index per node.

Parent -1 is the root: the request's last known token (the previous round's bonus), which the
target verifies together with the tree. A chain of s drafts has parents [-1, 0, 1, …, s-2].
Verification works on the *full* tree, root at index 0 and draft node i at index i + 1:

    drafts [a, b, c], parents [-1, 0, 0], prefix length 7
    full tree  [root, a, b, c], full parents [-1, 0, 1, 1], depths [0, 1, 2, 2]
    positions  [7, 8, 9, 9]; b and c both see the prefix, the root and a, not each other
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class MalformedTreeError(ValueError):
    """A candidate tree that breaks the parent/size/depth/vocabulary rules."""


@dataclass(frozen=True, slots=True)
class CandidateTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    # Sampling only: node i's token was drawn from q_i. Dense: draft_probs [n, V] float32 is
    # q. Sparse (`draft_ids` set): q_i gives draft_probs[i, j] to token draft_ids[i, j], for
    # K distinct ids per node, and 0 to every other token.
    draft_probs: Tensor | None = None
    draft_ids: Tensor | None = None  # [n, K] int64

    def __len__(self) -> int:
        return len(self.tokens)

    def dense_q(self, vocab_size: int) -> Tensor | None:
        """q [n, V] (None for a greedy tree)."""
        if self.draft_probs is None or self.draft_ids is None:
            return self.draft_probs
        q = self.draft_probs.new_zeros(len(self), vocab_size)
        return q.scatter_(-1, self.draft_ids.long(), self.draft_probs)

    def is_chain(self) -> bool:
        return tuple(self.parents) == chain_parents(len(self.parents))


def chain(
    tokens: Sequence[int], draft_probs: Tensor | None = None, draft_ids: Tensor | None = None
) -> CandidateTree:
    return CandidateTree(tuple(tokens), chain_parents(len(tokens)), draft_probs, draft_ids)


EMPTY_TREE = CandidateTree((), ())


def validate_tree(
    tree: CandidateTree,
    *,
    max_nodes: int,
    max_depth: int,
    vocab_size: int,
    sparse_q: bool = True,
) -> list[int]:
    """Checks the tree and returns the depth of each draft node (children of the root: 1).

    Parents must point to an earlier node (or -1), which rules out cycles and self-loops.
    `sparse_q=False` leaves a sparse q to the caller (`sparse_q_faults`, a round's at once).
    """
    n = len(tree.tokens)
    if len(tree.parents) != n:
        raise MalformedTreeError(f"tree has {n} tokens but {len(tree.parents)} parents")
    if n > max_nodes:
        raise MalformedTreeError(f"tree has {n} nodes, more than the limit {max_nodes}")
    if (
        tree.is_chain()
        and n <= max_depth
        and (not n or (min(tree.tokens) >= 0 and max(tree.tokens) < vocab_size))
    ):
        # a sound chain, the usual tree: checked in a few C calls, not node by node (64 tier-7
        # chains, 2-core CPU: 153 µs against 230); any fault takes the node loop, which names it
        depths = list(range(1, n + 1))
    else:
        depths = _node_depths(tree, max_depth, vocab_size)
    if tree.draft_ids is not None:
        if sparse_q:
            check_sparse_q(tree, vocab_size)
    elif tree.draft_probs is not None:
        if tuple(tree.draft_probs.shape) != (n, vocab_size):
            raise MalformedTreeError(
                f"draft_probs shape {tuple(tree.draft_probs.shape)} != ({n}, {vocab_size})"
            )
        rows = _float_rows(tree.draft_probs)
        check_draft_probs(rows, rows[np.arange(n), list(tree.tokens)])
    return depths


@functools.cache
def chain_parents(n: int) -> tuple[int, ...]:
    """The parents of a chain of n drafts: (-1, 0, …, n - 2)."""
    return tuple(range(-1, n - 1))


def _node_depths(tree: CandidateTree, max_depth: int, vocab_size: int) -> list[int]:
    """`validate_tree`'s node checks, node by node, raising on the first fault."""
    depths: list[int] = []
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        if not 0 <= token < vocab_size:
            raise MalformedTreeError(
                f"node {i}: token {token} outside the vocabulary [0, {vocab_size})"
            )
        if not -1 <= parent < i:
            raise MalformedTreeError(f"node {i}: parent {parent} must be -1 or an earlier node")
        depth = 1 if parent < 0 else depths[parent] + 1
        if depth > max_depth:
            raise MalformedTreeError(f"node {i}: depth {depth} exceeds the limit {max_depth}")
        depths.append(depth)
    return depths


def check_sparse_q(tree: CandidateTree, vocab_size: int) -> None:
    """A sparse q: ids [n, K] distinct per node inside the vocabulary, probs [n, K] a
    distribution per node, and each drafted token among its node's ids with mass."""
    ids, probs, n = tree.draft_ids, tree.draft_probs, len(tree)
    assert ids is not None
    if probs is None:
        raise MalformedTreeError("draft_token_ids without draft_probs")
    if ids.dim() != 2 or ids.shape[0] != n or not 0 < ids.shape[1] <= vocab_size:
        raise MalformedTreeError(f"draft_token_ids shape {tuple(ids.shape)} != ({n}, K <= V)")
    if tuple(probs.shape) != tuple(ids.shape):
        raise MalformedTreeError(
            f"draft_probs shape {tuple(probs.shape)} != draft_token_ids' {tuple(ids.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise MalformedTreeError(f"draft_token_ids: integer ids expected, got {ids.dtype}")
    # numpy: these run on every sampled tree of every round, and numpy's per-call cost on
    # arrays this small is a fifth of torch's (a tier-7 tree: 35 against 150 µs)
    at = ids.numpy()
    if ((at < 0) | (at >= vocab_size)).any():
        raise MalformedTreeError(f"draft_token_ids: an id outside the vocabulary [0, {vocab_size})")
    ordered = np.sort(at, -1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise MalformedTreeError("draft_token_ids: an id repeats within a node")
    q = _float_rows(probs)
    check_draft_probs(q, ((at == np.asarray(tree.tokens)[:, None]) * q).sum(-1))


def sparse_q_faults(trees: Sequence[CandidateTree], vocab_size: int) -> list[str | None]:
    """`check_sparse_q` of a round's trees (those without a sparse q pass): per tree the
    error it raises, or None. One numpy pass over the nodes of every tree of the usual shape
    (the cost is per call, not per node: 8 tier-7 trees cost about what 2 did alone); a tree
    it flags, or of another shape, is checked alone for its message."""
    faults: list[str | None] = [None] * len(trees)
    together: list[int] = []
    ids_rows: list[Tensor] = []
    q_rows: list[Tensor] = []
    for i, tree in enumerate(trees):
        ids, probs = tree.draft_ids, tree.draft_probs
        if ids is None:
            continue
        if (
            probs is not None
            and ids.dim() == 2
            and 0 < ids.shape[0] == len(tree)
            and probs.shape == ids.shape
            and ids.dtype in (torch.int32, torch.int64)
            and (not ids_rows or ids.shape[1] == ids_rows[0].shape[1])
        ):
            together.append(i)
            ids_rows.append(ids)
            q_rows.append(probs)
        else:
            faults[i] = _sparse_q_fault(tree, vocab_size)
    if not together:
        return faults
    # one gather a tensor, not a read per tree: 64 tier-7 trees 0.90 ms against 1.82 (2-core CPU)
    at, q = torch.cat(ids_rows).numpy(), _float_rows(torch.cat(q_rows))
    sizes = [len(trees[i]) for i in together]
    nodes = itertools.chain.from_iterable(trees[i].tokens for i in together)
    tokens = np.fromiter(nodes, dtype=np.int64, count=sum(sizes))
    ordered = np.sort(at, -1)
    bad = ((at < 0) | (at >= vocab_size)).any(-1) | (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    with np.errstate(invalid="ignore"):  # NaN rows: flagged by isfinite
        bad |= ~np.isfinite(q).all(-1) | (q < 0).any(-1)
        bad |= np.abs(q.sum(-1) - 1) > PROBS_TOLERANCE
        bad |= ((at == tokens[:, None]) * q).sum(-1) <= 0
    starts = np.cumsum([0, *sizes[:-1]])
    for i, flagged in zip(together, np.logical_or.reduceat(bad, starts), strict=True):
        if flagged:
            faults[i] = _sparse_q_fault(trees[i], vocab_size)
    return faults


def _sparse_q_fault(tree: CandidateTree, vocab_size: int) -> str | None:
    try:
        check_sparse_q(tree, vocab_size)
    except ValueError as exc:  # MalformedTreeError, or a shape torch refuses
        return str(exc)
    return None


def _float_rows(probs: Tensor) -> np.ndarray:
    return probs.detach().to(torch.float32).numpy()


PROBS_TOLERANCE = 1e-3  # |row sum - 1|: float32 rows of a 1e5 vocabulary sum within ~1e-5


def check_draft_probs(q: np.ndarray, drafted: np.ndarray) -> None:
    """What rejection sampling assumes of q [n, V]: each row a distribution, q(token) > 0.

    Acceptance is min(1, p(x) / q(x)): an all-zero, negative or NaN row, or a q that gives
    its own drafted token no mass, would accept tokens the target would rarely sample.
    q: [n, V] or sparse [n, K] (float32); drafted: [n], each node's q of its own drafted token.
    """
    if not np.isfinite(q).all():
        raise MalformedTreeError("draft_probs: a value is NaN or infinite")
    if (q < 0).any():
        raise MalformedTreeError("draft_probs: a probability is negative")
    sums = q.sum(-1)
    bad = np.abs(sums - 1) > PROBS_TOLERANCE
    if bad.any():
        row = int(bad.nonzero()[0][0])
        raise MalformedTreeError(f"draft_probs[{row}]: sums to {float(sums[row]):.6g}, not 1")
    if (drafted <= 0).any():
        node = int((drafted <= 0).nonzero()[0][0])
        raise MalformedTreeError(f"draft_probs[{node}]: its drafted token has probability 0")


def full_parents(tree: CandidateTree) -> list[int]:
    """Parents in the full tree (root at 0, node i at i + 1)."""
    return [-1] + [p + 1 for p in tree.parents]


def tree_mask(parents: Sequence[int]) -> Tensor:
    """[n, n] bool: mask[i, j] is True when j is i or an ancestor of i (parents[i] < i)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def tree_depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_positions(prefix_len: int, parents: Sequence[int]) -> Tensor:
    """Position of each full-tree node: prefix length + depth."""
    return torch.tensor([prefix_len + d for d in tree_depths(parents)], dtype=torch.long)


def children(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(i)
    return kids
