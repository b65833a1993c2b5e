"""Per-tier runtime states, all built at start-up; a tier switch swaps a reference.

A `SpecRuntimeState` holds everything shape-dependent for one tier (speculative_num_steps = s,
chains of s drafts, s + 1 verified tokens): the chain's parents, tree mask and depth offsets,
and this process's stages of the round — `verify` where it runs the target, `extend` and
`draft` where it runs the drafter — eager on the CPU, CUDA graphs per batch bucket on a GPU.
Tier 0 (no drafts) is a state too: the target verifies the pending token alone (a
one-token graph per bucket on a GPU); a draft at tier 0 only extends, eagerly (see
`Drafter.draft`), and the target does not call it for such rounds at all.
A `StateBuilder` builds them and counts what it built (`builds`, `captures`): the services
report those, and tests assert that nothing is built after start-up.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from specpair.logging import get_logger
from specpair.runtime.stages import (
    DraftStage,
    EagerDraft,
    EagerExtend,
    EagerVerify,
    ExtendStage,
    VerifyStage,
)  # fmt: skip
from specpair.runtime.tree import tree_depths, tree_mask

if TYPE_CHECKING:
    from specpair.runtime.draft import Drafter
    from specpair.runtime.graphs.capture import GraphCapture
    from specpair.runtime.graphs.draft import DraftGraphs
    from specpair.runtime.target import TargetWorker

log = get_logger(__name__)


class Timed(Protocol):
    """A target worker or drafter: the GPU time of its last call's graph replays."""

    last_gpu_ms: float


def gpu_ms(worker: Timed | None) -> float:
    """GPU time of the worker's last graph replays (0 without a worker, on the CPU, or when
    none ran)."""
    return 0.0 if worker is None else worker.last_gpu_ms


@dataclass(frozen=True)
class SpecRuntimeState:
    tier: int  # speculative_num_steps
    chain_parents: tuple[int, ...]  # full chain (root + s drafts): [-1, 0, 1, …, s-1]
    chain_mask: Tensor  # [s + 1, s + 1] bool, lower-triangular
    chain_depths: tuple[int, ...]  # [0, 1, …, s]
    verify: VerifyStage | None = None  # None: built without a target worker
    extend: ExtendStage | None = None  # None: built without a drafter
    draft: DraftStage | None = None

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


class StateBuilder:
    """Builds the states of `target` and/or `drafter` (a worker whose cache is on a GPU gets
    CUDA graphs per bucket: `buckets`, or powers of two up to its cache's slots; `ahead`: the
    drafter's graphs for pipelined rounds too)."""

    def __init__(
        self,
        target: TargetWorker | None = None,
        drafter: Drafter | None = None,
        *,
        buckets: Sequence[int] | None = None,
        ahead: bool = False,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.builds = 0
        self.target_graphs: GraphCapture | None = None
        self.draft_graphs: DraftGraphs | None = None
        if target is not None and target.cache.device.type == "cuda":
            from specpair.runtime.graphs.capture import GraphCapture

            slots = len(target.cache.lengths)
            self.target_graphs = GraphCapture(target.cache, slots, "target", buckets)
        if drafter is not None and drafter.cache.device.type == "cuda":
            from specpair.runtime.graphs.capture import GraphCapture
            from specpair.runtime.graphs.draft import DraftGraphs

            slots = len(drafter.cache.lengths)
            capture = GraphCapture(drafter.cache, slots, "draft", buckets)
            self.draft_graphs = DraftGraphs(capture, drafter, ahead)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        draft = None if self.draft_graphs is None else self.draft_graphs.capture
        return sum(g.captures for g in (self.target_graphs, draft) if g is not None)

    def build(self, tier: int) -> SpecRuntimeState:
        """The tier's state, its stages complete (graphs captured)."""
        if tier < 0:
            raise ValueError(f"a tier (speculative_num_steps) must be >= 0, got {tier}")
        parents = tuple(range(-1, tier))
        verify: VerifyStage | None = None
        extend: ExtendStage | None = None
        draft: DraftStage | None = None
        if self.target_graphs is not None and self.target is not None:
            from specpair.runtime.graphs.verify import VerifyGraphs

            verify = VerifyGraphs(self.target_graphs, self.target.model, tier)
        elif self.target is not None:
            verify = EagerVerify(self.target.model, self.target.cache, self.target.feature_layers)
        if self.draft_graphs is not None and tier > 0:
            extend, draft = self.draft_graphs.tier(tier)
        elif self.drafter is not None:
            extend, draft = EagerExtend(self.drafter), EagerDraft(self.drafter, tier)
        self.builds += 1
        return SpecRuntimeState(
            tier, parents, tree_mask(parents), tuple(tree_depths(parents)), verify, extend, draft
        )

    def build_all(self, tiers: Iterable[int]) -> dict[int, SpecRuntimeState]:
        """One state per candidate tier — called once, at start-up; logs each one's build time."""
        states = {}
        for tier in sorted(set(tiers)):
            t0 = time.perf_counter()
            states[tier] = self.build(tier)
            ms = round(1e3 * (time.perf_counter() - t0), 2)
            log.info("built runtime state", tier=tier, ms=ms)
        return states


def build_states(
    tiers: Iterable[int],
    target: TargetWorker | None = None,
    drafter: Drafter | None = None,
    *,
    buckets: Sequence[int] | None = None,
    ahead: bool = False,
) -> dict[int, SpecRuntimeState]:
    """`StateBuilder(target, drafter).build_all(tiers)`, for callers that count nothing."""
    return StateBuilder(target, drafter, buckets=buckets, ahead=ahead).build_all(tiers)
