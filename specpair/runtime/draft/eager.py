"""The drafter's eager stages: its own extend and step loop (the CPU's stages, and what the
GPU's graphs fall back to where none fits)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.tree_draft import draft_trees
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftQ, DraftSampling
from specpair.runtime.tree import CandidateTree


class EagerExtend:
    """The drafter's own extend (`Drafter.extend`)."""

    plans_ahead = False
    ahead = 0

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.cache = drafter, drafter.cache

    def prepare(self, slots: list[int]) -> None:
        return None

    def run(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        return self.drafter.extend(inputs, slots)


class EagerDraft:
    """The drafter's own step loop (`Drafter.draft_steps`), or a tree shape's eager draft
    (`tree_draft.draft_trees`)."""

    def __init__(self, drafter: Drafter, shape: TreeShape) -> None:
        self.drafter, self.shape, self.tier = drafter, shape, shape.steps

    def plan(self, slots: list[int]) -> None:
        return None

    def run(
        self, hidden: Tensor, slots: list[int], depths: Sequence[int] | None = None
    ) -> list[list[int]]:
        return self.drafter.draft_steps(hidden[: len(slots)], slots, self.tier, None, depths)[0]

    def run_sampled(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        return self.drafter.draft_steps(hidden[: len(slots)], slots, self.tier, sampling, depths)

    def run_tree(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling | None = None,
        depths: Sequence[int] | None = None,
    ) -> list[CandidateTree]:
        return draft_trees(self.drafter, hidden[: len(slots)], slots, self.shape, sampling, depths)

    def read_gpu_ms(self) -> float:
        return 0.0
