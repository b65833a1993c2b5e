"""A policy's estimate for one tier: made by the controller's policies, reported by the SDK."""

from __future__ import annotations

from dataclasses import dataclass

from specpair.runtime.shape import TreeShape


@dataclass(frozen=True, slots=True)
class TierEstimate:
    """A policy's prediction for one tier at the current batch size (status only)."""

    steps: int
    tokens_per_s: float  # batch · tokens_per_round / round time
    round_ms: float
    tokens_per_round: float  # per request: accepted drafts + the bonus token
    observed_rounds: int  # rounds measured at this tier and batch bucket (0: predicted)
    shape: str = ""  # the tier where it is a tree ("4x4x16"; `steps` is its depth)

    @property
    def tier(self) -> str:
        """The tier as written: "7", "4x4x16"."""
        return self.shape or str(self.steps)


@dataclass(frozen=True, slots=True)
class RegimeSteps:
    """A policy's batch tier for each sampling regime: batches that are all greedy, and batches
    where some request samples (they differ in both acceptance and cost; see the goodput
    policy). The target picks by the batch at each round's start."""

    greedy: TreeShape
    sampled: TreeShape

    def of(self, sampled: bool) -> TreeShape:
        return self.sampled if sampled else self.greedy
