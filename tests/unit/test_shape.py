"""Tier shapes: the syntax, the checks (each naming its field), and a tree shape's state."""

from __future__ import annotations

import pytest

from specpair.runtime.build import StateBuilder
from specpair.runtime.shape import MAX_TREE_NODES, ShapeError, TreeShape
from specpair.runtime.state import tier_state


def test_a_chain_is_its_steps() -> None:
    assert TreeShape.parse("7") == TreeShape.parse(7) == TreeShape(7) == TreeShape(7, 1, 7)
    assert TreeShape(7).is_chain and str(TreeShape(7)) == "7"
    tree = TreeShape.parse("4x4x16")
    assert (tree.steps, tree.topk, tree.num_draft_tokens, str(tree)) == (4, 4, 16, "4x4x16")
    assert not tree.is_chain and tree.verified == 17 and tree.draft_rows == 12


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("4x4", "STEPSxTOPKxNUM_DRAFT_TOKENS"),
        ("a", "STEPS"),
        ("3x1x5", "num_draft_tokens"),
        ("0x2x1", "steps"),
        ("2x0x1", "topk"),
        ("2x2x7", "num_draft_tokens"),  # 2 + 4 candidates
        (f"6x8x{MAX_TREE_NODES + 1}", "MAX_TREE_NODES"),
        ("-1", "speculative_num_steps"),
    ],
)
def test_bad_shapes_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ShapeError, match=field):
        TreeShape.parse(text)


def test_a_tree_state_keeps_its_shape_and_its_depth_chain() -> None:
    state = tier_state(TreeShape(4, 4, 16))
    assert state.tier == 4 and not state.is_chain and state.tree_shape == TreeShape(4, 4, 16)
    assert state.chain_parents == (-1, 0, 1, 2, 3)
    assert tier_state(3).is_chain and tier_state(3).tree_shape == TreeShape(3)


def test_tree_shapes_are_refused_on_cuda() -> None:
    builder = StateBuilder()
    builder.target_graphs = object()  # type: ignore[assignment]  # what a CUDA worker has
    with pytest.raises(ValueError, match="tree_shapes: tree shape 4x4x16 on a CUDA device"):
        builder.build(TreeShape(4, 4, 16))
    assert builder.build(0).tier == 0  # chains still build
