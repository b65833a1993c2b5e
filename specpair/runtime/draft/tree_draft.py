"""Tree drafting, EAGLE-2 style: `topk` candidates per expanded node for `steps` steps, the
`topk` best frontier nodes (by cumulative draft log-probability) expanded at each step, then
the best `num_draft_tokens` of all candidates kept as the tree.

    steps 3, topk 2: the root's top 2 → depth 1 (both expanded); their 2 × 2 children → the
    best 2 of those expanded; their 2 × 2 children: 2 + 4 + 4 = 10 candidates, the best
    num_draft_tokens kept. A kept node's score (its path's log-probability) is at most its
    parent's, so the best n of them always hold every kept node's parent (ties: shallower first).

The draft's KV of a tree is tentative like a chain's (never committed: the next round's
appended tokens overwrite it). Nodes of one depth are siblings that must not see one another,
and a layout shows every position before its start to all its rows, so each step *recomputes*:
step d runs every expanded node so far (d · topk rows, in the order they were expanded) from
the committed length with their tree mask, written over the previous step's rows with the same
values, and reads the last topk rows' outputs. It costs topk · d rows at step d (a chain: one)
and needs nothing of the attention backends beyond the target's tree mask.

Sampled requests draft the same way from their temperature-scaled distribution: the target
verifies such a tree with SGLang's target-only rule (`accept.accept_trees`), which needs no q
and is exact for candidates chosen by any rule that does not look at the target's draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.runtime.draft.extend import DraftForward
from specpair.runtime.layout import BatchLayout
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftSampling
from specpair.runtime.tree import CandidateTree
from specpair.runtime.tree_grow import grow_tree, rerank_trees


def draft_trees(
    drafter: DraftForward,
    hidden: Tensor,
    slots: list[int],
    shape: TreeShape,
    sampling: DraftSampling | None = None,
    depths: Sequence[int] | None = None,
) -> list[CandidateTree]:
    """A tree of `shape` per request from its last hidden [B, 1, H] (the extend's, at the
    root), eagerly on the device; `depths[b]` caps request b's tree (default `shape.steps`).
    The host reads the candidates back once, at the end."""
    b, dev = len(slots), hidden.device
    cache = drafter.cache
    starts = torch.tensor([cache.lengths[s] for s in slots])

    def forward(tokens: Tensor, feats: Tensor | None, positions: Tensor, mask: Tensor) -> Tensor:
        for slot, start in zip(slots, starts.tolist(), strict=True):
            cache.check_room(slot, start, tokens.shape[1])
        layout = BatchLayout(torch.tensor(slots), starts, mask.cpu())
        return drafter.forward(tokens, feats, positions, cache.bind(layout))

    params = None if sampling is None else sampling.params.to(dev)  # a row per request
    temperature = None if params is None else params.temperature
    pool = grow_tree(
        drafter.logits, drafter.needs_features, hidden, starts.to(dev), shape, temperature, forward
    )
    return rerank_trees(pool, shape, b, depths)
