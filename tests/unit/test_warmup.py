"""The warm-up's pieces: its dummy trees are valid trees of their shape, as a draft sends them,
and its leak check fails on a slot held."""

from __future__ import annotations

import pytest
import torch

from specpair.runtime.kv_cache import KVCache
from specpair.runtime.shape import TreeShape
from specpair.runtime.tree import sparse_q_faults, tree_depths, validate_tree
from specpair.runtime.warmup import Held, dummy_tree


@pytest.mark.parametrize(
    "shape",
    [TreeShape(1), TreeShape(7), TreeShape(2, 2, 5), TreeShape(4, 4, 16), TreeShape(5, 4, 20)],
)
@pytest.mark.parametrize("sampled", [False, True])
def test_a_dummy_tree_is_a_valid_tree_of_its_shape(shape: TreeShape, sampled: bool) -> None:
    tree = dummy_tree(shape, 320, sampled)
    assert len(tree) == shape.num_draft_tokens
    validate_tree(tree, max_nodes=shape.num_draft_tokens, max_depth=shape.steps, vocab_size=320)
    assert max(tree_depths(list(tree.parents))) < shape.steps  # children of the root: 0
    siblings = [[i for i, p in enumerate(tree.parents) if p == q] for q in range(-1, len(tree))]
    assert all(len(kids) <= shape.topk for kids in siblings)
    if sampled:
        assert tree.draft_ids is not None and tree.draft_probs is not None
        assert (tree.draft_ids[:, 0] == torch.tensor(tree.tokens)).all()
        assert sparse_q_faults([tree], 320) == [None]


def test_held_names_what_the_warm_up_kept() -> None:
    cache = KVCache(
        num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=4, max_requests=2, max_len=32
    )
    held = Held(cache)
    slot = cache.alloc()
    cache.reserve(slot, 20)
    with pytest.raises(RuntimeError, match="1 slots and 2 KV pages still held"):
        held.check("draft")
    cache.free(slot)
    held.check("draft")
