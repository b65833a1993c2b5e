"""Per-tier runtime states, all built at start-up; a tier switch swaps a reference.

A `SpecRuntimeState` holds everything shape-dependent for one tier: its `TreeShape` (`shape.py`:
a chain of s drafts, s + 1 verified tokens, or a tree of steps × topk → num_draft_tokens), the
chain's parents, tree mask and depth offsets (what a planned verify of a chain tier reuses),
and this process's stages of the round — `verify` where it runs the target, `extend` and
`draft` where it runs the drafter — eager on the CPU, CUDA graphs per batch bucket on a GPU.
Tier 0 (no drafts) is a state too: the target verifies the pending token alone (a
one-token graph per bucket on a GPU); a draft at tier 0 only extends, eagerly (see
`Drafter.draft`), and the target does not call it for such rounds at all.
A `StateBuilder` (`build.py`) builds them and counts what it built (`builds`, `captures`): the
services report those, and tests assert that nothing is built after start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftStage, ExtendStage, VerifyStage
from specpair.runtime.tree import tree_depths, tree_mask


class Timed(Protocol):
    """A target worker or drafter: the GPU time of its last call's graph replays."""

    last_gpu_ms: float


def gpu_ms(worker: Timed | None) -> float:
    """GPU time of the worker's last graph replays (0 without a worker, on the CPU, or when
    none ran)."""
    return 0.0 if worker is None else worker.last_gpu_ms


@dataclass(frozen=True)
class SpecRuntimeState:
    tier: int  # speculative_num_steps: the tree's depth (a chain's drafts)
    chain_parents: tuple[int, ...]  # full chain (root + s drafts): [-1, 0, 1, …, s-1]
    chain_mask: Tensor  # [s + 1, s + 1] bool, lower-triangular
    chain_depths: tuple[int, ...]  # [0, 1, …, s]
    verify: VerifyStage | None = None  # None: built without a target worker
    extend: ExtendStage | None = None  # None: built without a drafter
    draft: DraftStage | None = None
    shape: TreeShape | None = None  # None: the chain of `tier` (`tier_state` always sets it)

    @property
    def tree_shape(self) -> TreeShape:
        return self.shape if self.shape is not None else TreeShape(self.tier)

    @property
    def is_chain(self) -> bool:
        return self.shape is None or self.shape.is_chain

    def verify_stage(self) -> VerifyStage:
        if self.verify is None:
            raise RuntimeError(f"tier {self.tier}: state built without a target worker")
        return self.verify

    def extend_stage(self) -> ExtendStage:
        if self.extend is None:
            raise RuntimeError(f"tier {self.tier}: state built without a drafter")
        return self.extend

    def draft_stage(self) -> DraftStage:
        if self.draft is None:
            raise RuntimeError(f"tier {self.tier}: state built without a drafter")
        return self.draft


def tier_state(
    tier: int | TreeShape,
    verify: VerifyStage | None = None,
    extend: ExtendStage | None = None,
    draft: DraftStage | None = None,
) -> SpecRuntimeState:
    """The state of a tier (s: chains of s drafts; or a `TreeShape`), with these stages. A tree
    shape keeps its depth's chain as `chain_*` (a request drafted to a shorter depth, or a tree
    that came out a chain, verifies through them like a chain tier's)."""
    shape = tier if isinstance(tier, TreeShape) else TreeShape(tier)
    parents = tuple(range(-1, shape.steps))
    depths = tuple(tree_depths(parents))
    return SpecRuntimeState(
        shape.steps,
        parents,
        tree_mask(parents),
        depths,
        verify,
        extend,
        draft,
        shape,
    )
