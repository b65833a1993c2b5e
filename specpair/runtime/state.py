"""Per-tier runtime states, all built at start-up; a tier switch swaps a reference.

A `SpecRuntimeState` holds everything shape-dependent for one tier (speculative_num_steps = s,
chains of s drafts, s + 1 verified tokens). On CPU that is the chain's parents, tree mask and
depth offsets, precomputed once; on a GPU each worker passed to `build_states` captures its
CUDA graphs per batch bucket into the same object. `builds()` counts constructions so tests can
assert that none happen after start-up.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from specpair.logging import get_logger
from specpair.runtime.kv_cache import BatchLayout
from specpair.runtime.tree import tree_depths, tree_mask

log = get_logger(__name__)

_builds = 0


class TierCapture(Protocol):
    """A worker's CUDA graphs: captures its stages of one tier into a state, times replays."""

    last_gpu_ms: float  # GPU time of the last call's replays (0: none ran)

    def capture_tier(self, state: SpecRuntimeState) -> None: ...

    def read_gpu_ms(self) -> float: ...


class VerifyPlan(Protocol):
    """A tier's verify graphs: `plan` the layout (once ahead, or per call), then `replay`."""

    def plan(self, positions: Tensor, layout: BatchLayout, key: object = None) -> bool: ...

    def planned_for(self, key: object) -> bool: ...

    def replay(self, tokens: Tensor) -> tuple[Tensor, Tensor]: ...


class GraphOwner(Protocol):
    """A target worker or drafter: `graphs` is its TierCapture on a GPU, None on the CPU."""

    graphs: TierCapture | None


def gpu_ms(worker: GraphOwner | None) -> float:
    """GPU time of the worker's last graph replays (0 on the CPU, or when none ran)."""
    graphs = None if worker is None else worker.graphs
    return 0.0 if graphs is None else graphs.last_gpu_ms


def builds() -> int:
    """How many runtime states this process has built so far."""
    return _builds


@dataclass(frozen=True)
class SpecRuntimeState:
    tier: int  # speculative_num_steps
    chain_parents: tuple[int, ...]  # full chain (root + s drafts): [-1, 0, 1, …, s-1]
    chain_mask: Tensor  # [s + 1, s + 1] bool, lower-triangular
    chain_depths: tuple[int, ...]  # [0, 1, …, s]
    extras: dict[str, object] = field(default_factory=dict)  # backend-specific (graphs, plans)

    @property
    def num_draft_tokens(self) -> int:
        return self.tier + 1


def build_state(tier: int, workers: Iterable[GraphOwner] = ()) -> SpecRuntimeState:
    """The tier's state; each GPU worker in `workers` captures its graphs into it."""
    global _builds
    if tier < 1:
        raise ValueError(f"a tier (speculative_num_steps) must be >= 1, got {tier}")
    parents = tuple(range(-1, tier))
    _builds += 1
    state = SpecRuntimeState(tier, parents, tree_mask(parents), tuple(tree_depths(parents)))
    for worker in workers:
        if worker.graphs is not None:
            worker.graphs.capture_tier(state)
    return state


def build_states(
    tiers: Iterable[int], workers: Iterable[GraphOwner] = ()
) -> dict[int, SpecRuntimeState]:
    """One state per candidate tier, with `workers`' graphs — called once, at start-up; logs
    each tier's build time."""
    workers = list(workers)
    states = {}
    for tier in sorted(set(tiers)):
        t0 = time.perf_counter()
        states[tier] = build_state(tier, workers)
        log.info("built runtime state", tier=tier, ms=round(1e3 * (time.perf_counter() - t0), 2))
    return states
