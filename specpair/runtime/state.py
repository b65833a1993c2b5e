"""Per-tier runtime states, all built at start-up; a tier switch swaps a reference.

A `SpecRuntimeState` holds everything shape-dependent for one tier (speculative_num_steps = s,
chains of s drafts, s + 1 verified tokens). On CPU that is the chain's parents, tree mask and
depth offsets, precomputed once; the GPU backend adds attention plans and CUDA graphs per batch
bucket to the same object. `builds()` counts constructions so tests can assert that none
happen after start-up.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import Tensor

from specpair.logging import get_logger
from specpair.runtime.tree import tree_depths, tree_mask

log = get_logger(__name__)

_builds = 0
# GPU workers register a method that captures their graphs into each new state (weakly held, so
# a dropped worker stops capturing); the services keep calling plain `build_state(tier)`.
_stage_builders: list[weakref.WeakMethod[Callable[[SpecRuntimeState], None]]] = []


def register_stage_builder(method: Callable[[SpecRuntimeState], None]) -> None:
    """`method(state)` runs inside every later `build_state` (CUDA-graph capture)."""
    _stage_builders.append(weakref.WeakMethod(method))  # type: ignore[arg-type]


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


def build_state(tier: int) -> SpecRuntimeState:
    global _builds
    if tier < 1:
        raise ValueError(f"a tier (speculative_num_steps) must be >= 1, got {tier}")
    parents = tuple(range(-1, tier))
    _builds += 1
    state = SpecRuntimeState(tier, parents, tree_mask(parents), tuple(tree_depths(parents)))
    for ref in list(_stage_builders):
        builder = ref()
        if builder is None:
            _stage_builders.remove(ref)
        else:
            builder(state)
    return state


def build_states(tiers: Iterable[int]) -> dict[int, SpecRuntimeState]:
    """One state per candidate tier — called once, at start-up; logs each tier's build time."""
    states = {}
    for tier in sorted(set(tiers)):
        t0 = time.perf_counter()
        states[tier] = build_state(tier)
        log.info("built runtime state", tier=tier, ms=round(1e3 * (time.perf_counter() - t0), 2))
    return states
