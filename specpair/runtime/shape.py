"""A tier's shape: how the draft grows its candidate tree (EAGLE-2's `steps`, `topk`,
`num_draft_tokens`).

    steps 3, topk 1, num_draft_tokens 3   the chain of tier 3: "3"
    steps 4, topk 4, num_draft_tokens 16  a tree: "4x4x16" — 4 candidates per expanded node, the
                                          4 best frontier nodes expanded per step, 4 steps deep,
                                          the best 16 nodes kept

A chain is written as its steps alone, so `[1, 3, 7]` keeps meaning chains of 1, 3, 7 drafts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The largest tree a target accepts (`DraftSession.max_tree_nodes`, a request's KV headroom past
# its context): bounds a shape's num_draft_tokens.
MAX_TREE_NODES = 64


class ShapeError(ValueError):
    """A shape that cannot be drafted; the message names the field."""


@dataclass(frozen=True, slots=True, order=True)
class TreeShape:
    steps: int  # depth of the tree (speculative_num_steps)
    topk: int = 1  # candidates per expanded node, and frontier nodes expanded per step
    num_draft_tokens: int = -1  # nodes kept (-1: steps, a chain)

    def __post_init__(self) -> None:
        if self.num_draft_tokens == -1:
            object.__setattr__(self, "num_draft_tokens", self.steps if self.topk == 1 else -1)
        s, k, n = self.steps, self.topk, self.num_draft_tokens
        if s < 0:
            raise ShapeError(f"a tier (speculative_num_steps) must be >= 0, got {s}")
        if k < 1:
            raise ShapeError(f"topk must be >= 1, got {k}")
        if k == 1 and n != s:
            raise ShapeError(f"num_draft_tokens {n}: a chain (topk 1) keeps its {s} steps")
        if k > 1:
            if s < 1:
                raise ShapeError(f"steps must be >= 1 for a tree (topk {k}), got {s}")
            pool = k + (s - 1) * k * k  # the candidates the steps draft
            if not 1 <= n <= min(pool, MAX_TREE_NODES):
                raise ShapeError(
                    f"num_draft_tokens must be in [1, {min(pool, MAX_TREE_NODES)}] for steps "
                    f"{s}, topk {k} (at most {pool} candidates; MAX_TREE_NODES "
                    f"{MAX_TREE_NODES}), got {n}"
                )

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def verified(self) -> int:
        """Tokens one request verifies: the root and the kept nodes."""
        return self.num_draft_tokens + 1

    @property
    def draft_rows(self) -> int:
        """Tentative positions the draft writes past its committed length: a chain's s - 1 steps
        after the root; a tree's last forward, every expanded node ((s - 1) · topk)."""
        return max(self.steps - 1, 0) * self.topk

    @property
    def draft_headroom(self) -> int:
        """Cache positions a draft keeps free past a request's tokens for this tier: a chain's
        steps, a tree's kept nodes or its last forward's rows, whichever is more (6x8x32: 40)."""
        return max(self.num_draft_tokens, self.draft_rows)

    def __str__(self) -> str:
        if self.is_chain:
            return str(self.steps)
        return f"{self.steps}x{self.topk}x{self.num_draft_tokens}"

    @staticmethod
    def parse(text: str | int) -> TreeShape:
        """ "7" → the chain of 7; "4x4x16" → steps 4, topk 4, num_draft_tokens 16."""
        if isinstance(text, int):
            return TreeShape(text)
        parts = str(text).strip().lower().split("x")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ShapeError(
                f"a shape is STEPS or STEPS x TOPK x NUM_DRAFT_TOKENS (e.g. 7, 4x4x16), got "
                f"{text!r}"
            ) from None
        if len(values) == 1:
            return TreeShape(values[0])
        if len(values) != 3:
            raise ShapeError(f"a tree shape is STEPSxTOPKxNUM_DRAFT_TOKENS, got {text!r}")
        return TreeShape(*values)


def tier_name(shape: TreeShape) -> str:
    """A tier's wire string beside its int steps: "" for a chain, "4x4x16" for a tree."""
    return "" if shape.is_chain else str(shape)


def tier_from_wire(steps: int, shape: str, name: str) -> TreeShape:
    """The tier a message names by its int steps and, for a tree, its shape string; raises
    ShapeError naming the field (`name`, e.g. "speculative_num_steps") of a bad one.

    (7, "") → the chain of 7; (0 or 4, "4x4x16") → the tree; (3, "4x4x16") → refused."""
    if not shape:
        if steps < 0:
            raise ShapeError(f"{name} must be >= 0, got {steps}")
        return TreeShape(steps)
    try:
        tree = TreeShape.parse(shape)
    except ShapeError as exc:
        raise ShapeError(f"{name}: {exc}") from None
    if steps not in (0, tree.steps):
        raise ShapeError(f"{name} {steps} disagrees with shape {shape!r} ({tree.steps} steps)")
    return tree


def parse_tiers(steps: Iterable[int], shapes: Iterable[str]) -> tuple[TreeShape, ...]:
    """The candidates a config or a policy names: chains of `steps` and the tree `shapes`,
    sorted; raises ShapeError naming the bad one (a shape that is a chain belongs in steps)."""
    tiers = [TreeShape(s) for s in steps]
    for text in shapes:
        try:
            tree = TreeShape.parse(text)
        except ShapeError as exc:
            raise ShapeError(f"tree_shapes: {exc}") from None
        if tree.is_chain:
            raise ShapeError(f"tree_shapes {text!r} is a chain: list it in candidate_steps")
        tiers.append(tree)
    if len(set(tiers)) != len(tiers):
        raise ShapeError(f"tree_shapes repeat a tier: {[str(t) for t in tiers]}")
    return tuple(sorted(tiers))
