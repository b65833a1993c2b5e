"""Candidate trees (topk > 1, EAGLE-2 style) keep greedy speculative decoding equal to
transformers' greedy generate, token for token, for both drafters and several shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpair.runtime.build import StateBuilder, build_drafter, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from tests.engine.test_greedy_lossless import NEW_TOKENS, PROMPTS, hf_greedy

SHAPES = [TreeShape(2, 2, 3), TreeShape(3, 2, 6), TreeShape(4, 4, 16), TreeShape(5, 3, 12)]


@pytest.fixture(scope="module")
def references(ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {t: [hf_greedy(ckpts[t], p) for p in PROMPTS] for t in ("target", "target_b")}


def run(target: Path, draft: Path, shape: TreeShape, prompts, request_steps=None):
    worker = build_target(target, max_requests=4, max_len=160, keep_features=True)
    drafter = build_drafter(draft, target_path=target, max_requests=4, max_len=160)
    state = StateBuilder(worker, drafter).build(shape)
    engine = SpeculativeEngine(worker, drafter)
    return engine.generate(
        prompts, max_new_tokens=NEW_TOKENS, state=state, request_steps=request_steps
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    ("target", "draft"),
    [("target", "target"), ("target", "draft"), ("target", "eagle"), ("target_b", "draft_b")],
)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_trees_match_transformers(
    ckpts: dict[str, Path], references, target: str, draft: str, shape: TreeShape, batch: int
) -> None:
    prompts = PROMPTS if batch == 4 else PROMPTS[1:2]
    expected = references[target] if batch == 4 else references[target][1:2]
    results = run(ckpts[target], ckpts[draft], shape, prompts)
    assert [r.token_ids for r in results] == expected
    lengths = [a for r in results for a in r.accept_lengths]
    assert all(0 <= a <= shape.steps for a in lengths)
    if draft == target:
        # the draft is the target: its argmax, the best-scored node, is kept and accepted
        # (further down, its greedy path may rank below wider nodes and be cut)
        assert all(a >= 1 for r in results for a in r.accept_lengths[:-1])


@pytest.mark.parametrize("draft", ["draft", "eagle"])
def test_per_request_depths_in_a_tree_round(ckpts: dict[str, Path], references, draft) -> None:
    """One round at shape 4x3x10, requests capped at depths 0, 1, 2 and 4."""
    steps = [0, 1, 2, 4]
    results = run(ckpts["target"], ckpts[draft], TreeShape(4, 3, 10), PROMPTS, steps)
    assert [r.token_ids for r in results] == references["target"]
    for r, s in zip(results, steps, strict=True):
        assert all(0 <= a <= s for a in r.accept_lengths)


@pytest.mark.parametrize("draft", ["draft", "eagle"])
def test_drafted_trees_are_valid_and_ranked(ckpts: dict[str, Path], draft: str) -> None:
    """Each tree has num_draft_tokens nodes, parents before children, distinct siblings, depth
    at most steps; a chain shape's state drafts what the tree of topk 1 would."""
    shape = TreeShape(4, 3, 12)
    drafter = build_drafter(ckpts[draft], target_path=ckpts["target"], max_requests=2, max_len=64)
    features = torch.randn(6, drafter.args.hidden_size) if drafter.needs_features else None
    inputs = [
        DraftInput(f"r{i}", (5, 6, 7, 8, 9, 10 + i), SamplingParams(), features) for i in range(2)
    ]
    state = StateBuilder(None, drafter).build(shape)
    trees = drafter.draft(inputs, state)
    for tree in trees:
        assert len(tree) == 12
        depth: list[int] = []
        for i, parent in enumerate(tree.parents):
            assert -1 <= parent < i
            depth.append(1 if parent < 0 else depth[parent] + 1)
        assert max(depth) <= 4
        for parent in set(tree.parents):
            kids = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == parent]
            assert len(kids) == len(set(kids)) <= 3
    # node 0, the best-scored, is the draft's argmax: the first token of its greedy chain
    for item in inputs:
        drafter.release(item.request_id)
    chains = drafter.draft(inputs, StateBuilder(None, drafter).build(3))
    assert [c.tokens[0] for c in chains] == [t.tokens[0] for t in trees]
    assert all(c.is_chain() and len(c) == 3 for c in chains)
