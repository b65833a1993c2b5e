"""Tier shapes: the syntax, the checks (each naming its field), and a tree shape's state."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.runtime.shape import MAX_TREE_NODES, ShapeError, TreeShape, tier_from_wire, tier_name
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


@pytest.mark.parametrize(
    ("steps", "shape", "expected"),
    [(7, "", TreeShape(7)), (0, "4x4x16", TreeShape(4, 4, 16)), (4, "4x4x16", TreeShape(4, 4, 16))],
)
def test_a_tier_on_the_wire_is_its_steps_and_a_trees_shape(steps, shape, expected) -> None:
    assert tier_from_wire(steps, shape, "speculative_num_steps") == expected
    assert tier_name(expected) == ("" if expected.is_chain else shape)


@pytest.mark.parametrize(
    ("steps", "shape", "match"),
    [
        (-1, "", "greedy_steps must be >= 0"),
        (3, "4x4x16", "greedy_steps 3 disagrees with shape '4x4x16'"),
        (0, "4x4", "greedy_steps: a tree shape is"),
    ],
)
def test_a_bad_tier_on_the_wire_names_its_field(steps, shape, match) -> None:
    with pytest.raises(ShapeError, match=match):
        tier_from_wire(steps, shape, "greedy_steps")


def test_the_services_build_tree_shapes_beside_the_chains() -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser
    from specpair.config import DraftConfig, ServerConfig, TargetConfig

    server = ServerConfig(address="127.0.0.1:0")
    cfg = TargetConfig(server, Path("m"), tree_shapes=("6X8X32", "4x4x16"), initial_shape="4x4x16")
    assert cfg.tree_shapes == ("4x4x16", "6x8x32")  # canonical, as GetServerInfo reports them
    assert [str(t) for t in cfg.tiers] == ["1", "3", "4x4x16", "6x8x32", "7"]
    assert cfg.initial_tier == TreeShape(4, 4, 16)
    # the draft keeps room for a tree's widest forward: 6x8x32 writes (6 - 1) * 8 = 40 rows
    draft = DraftConfig(server, Path("d"), tree_shapes=("6x8x32",), max_len=100)
    assert draft.cache_len == 140
    for bad, match in [
        (dict(tree_shapes=("4x4",)), "tree_shapes: a tree shape is"),
        (dict(tree_shapes=("3",)), "tree_shapes '3' is a chain"),
        (dict(tree_shapes=("4x4x16", "4x4x16")), "tree_shapes repeat a tier"),
        (dict(initial_shape="4x4x16"), "initial_shape 4x4x16 is not a candidate"),
    ]:
        with pytest.raises(ValueError, match=match):
            TargetConfig(server, Path("m"), **bad)
    parser = build_parser()
    args = parser.parse_args(["serve", "target", "--model", "m", "--tree-shapes", "4x4x16"])
    assert args.tree_shapes == ["4x4x16"]
    services, _ = up_services(parser.parse_args(["up", "--tree-shapes", "4x4x16"]))
    for name in ("draft", "target"):
        argv = next(s.args for s in services if s.name == name)
        assert argv[argv.index("--tree-shapes") + 1] == "4x4x16"
