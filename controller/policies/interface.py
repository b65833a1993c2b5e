"""What every speculation policy sees (a round) and answers (a tier), and the guards they share.

A policy is pure: the controller turns each RoundStats into a `RoundSample`, feeds it to
`observe`, and sends ApplyTier when `observe` says the tier changed. Tier 0 means no drafts:
the target verifies one token per request (a plain decode round). A tier is a `TreeShape`: a
chain of s drafts (`TreeShape(s)`, "7") or a tree ("4x4x16"); a policy that names its tiers by
int steps alone (a `--policy-class` written for chains) chooses among chains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps, TierEstimate


@dataclass(frozen=True, slots=True)
class RoundSample:
    """One round of the running batch, as the target reported it (times in ms).

    `steps` is the tier the round ran at, 0 for a round without drafts (`accept_lengths` empty),
    and `shape` that tier where it is a tree (`steps` its depth; in a tree round a request's own
    tier in `request_steps` caps its depth); `accept_lengths` are accepted drafts per request,
    bonus excluded. The round's wall time is
    `total_ms`; its speculation overhead is `total_ms − verify_ms − schedule_ms` (the round trip
    to the draft: wire, extend and draft), of which `draft_ms` grows with the tier.
    """

    steps: int
    batch_size: int
    accept_lengths: tuple[int, ...] = ()
    total_ms: float = 0.0
    verify_ms: float = 0.0
    draft_ms: float = 0.0
    schedule_ms: float = 0.0
    admit_ms: float = 0.0  # prefill of joining requests: in total_ms, not in schedule_ms
    # Per-request tiers: parallel to accept_lengths, whose each one is and its own tier; the
    # round's other requests (not drafted) in plain_request_ids. Empty from an older target.
    request_ids: tuple[str, ...] = ()
    request_steps: tuple[int, ...] = ()
    plain_request_ids: tuple[str, ...] = ()
    sampled: int = 0  # requests of the batch that sample (temperature > 0)
    shape: TreeShape | None = None  # the round's tier where it is a tree

    @property
    def tier(self) -> TreeShape:
        return self.shape or TreeShape(self.steps)

    @property
    def speculative(self) -> bool:
        return self.steps > 0 and bool(self.accept_lengths)

    @property
    def round_trip_ms(self) -> float:
        """Draft round trip (wire + extend + draft); 0 for a round without drafts."""
        if not self.speculative:
            return 0.0
        return max(self.total_ms - self.admit_ms - self.verify_ms - self.schedule_ms, self.draft_ms)


@runtime_checkable
class SpeculationPolicy(Protocol):
    """The interface behind `--policy-class module:Class` (constructed as
    `Class(options: Mapping[str, Any], initial_steps: int)`, `options` being the policy file's
    keys); the built-in kinds implement it too."""

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        """Every tier the policy may choose; the target must have built each."""
        ...

    @property
    def current_steps(self) -> int: ...

    @property
    def ema(self) -> float:
        """The headline estimate the status shows (accepted drafts per request per round)."""
        ...

    @property
    def count(self) -> int:
        """Rounds counted toward the warm-up and interval gates."""
        ...

    def observe(self, sample: RoundSample) -> bool:
        """Feeds one round; True if `current_steps` changed."""
        ...

    def resume(self, ema: float, count: int) -> None:
        """Continues from a saved headline estimate and count (a restarted controller)."""
        ...

    def reconfigure(self, options: Mapping[str, Any]) -> bool:
        """Swaps in new options keeping what was learnt; True if `current_steps` changed."""
        ...

    def estimates(self) -> tuple[TierEstimate, ...]:
        """Per candidate tier, predicted tokens/s (empty for a rule without a cost model)."""
        ...

    def describe(self) -> str:
        """One line on the model behind the decisions, for the status."""
        ...


@runtime_checkable
class PerRequestPolicy(SpeculationPolicy, Protocol):
    """A policy that also tiers each request (`controller.policies.request_tiers:RequestTiers`): the
    controller sends `request_steps` with every ApplyTier the policy asks for."""

    @property
    def request_steps(self) -> Mapping[str, int]:
        """Request id → its tier where it differs from `current_steps` (ids as in RoundStats)."""
        ...


@runtime_checkable
class RegimePolicy(SpeculationPolicy, Protocol):
    """A policy that keeps a tier per sampling regime (the goodput kind): the controller sends
    both with every ApplyTier, and the target picks by each batch, so that a batch turning
    greedy or sampled runs at that regime's tier from its first round."""

    @property
    def regime_steps(self) -> RegimeSteps | None:
        """The batch tier for each regime (the current regime's is `current_steps`); None:
        one tier for every batch."""
        ...


@runtime_checkable
class ShapedPolicy(SpeculationPolicy, Protocol):
    """A policy whose tiers may be trees (the built-in kinds): the controller reads its tiers
    as shapes; `current_steps` and `candidate_steps` are then the current tier's depth and the
    chains' steps."""

    @property
    def candidate_tiers(self) -> tuple[TreeShape, ...]:
        """Every tier the policy may choose, chains and trees; the target must have built each."""
        ...

    @property
    def current_tier(self) -> TreeShape: ...


def policy_tier(policy: SpeculationPolicy) -> TreeShape:
    """The tier `policy` chose: its shape, or the chain of its steps."""
    if isinstance(policy, ShapedPolicy):
        return policy.current_tier
    return TreeShape(policy.current_steps)


def policy_regimes(policy: SpeculationPolicy) -> RegimeSteps | None:
    """The batch tier per sampling regime, where `policy` keeps one (ints read as chains)."""
    return policy.regime_steps if isinstance(policy, RegimePolicy) else None


def as_tier(tier: int | TreeShape) -> TreeShape:
    """A tier named by its int steps (a chain) or by its shape."""
    return tier if isinstance(tier, TreeShape) else TreeShape(tier)


class DecisionGate:
    """The warm-up and interval guards: no decision in the first `warmup` counted rounds, then
    one every `interval`. With warmup 10 and interval 5, counts 15, 20, 25, … decide."""

    def __init__(self, warmup: int, interval: int, count: int = 0) -> None:
        self.warmup, self.interval, self.count = warmup, interval, count

    def tick(self) -> bool:
        """Counts one round; True when this one may decide."""
        self.count += 1
        return self.due()

    def due(self) -> bool:
        past = self.count - self.warmup
        return past > 0 and past % self.interval == 0

    def retune(self, warmup: int, interval: int) -> None:
        self.warmup, self.interval = warmup, interval


def snap_to_candidate(steps: int, candidates: Sequence[int]) -> int:
    """Nearest candidate, ties to the larger: with [1, 3, 7], 2 → 3 and 5 → 7."""
    return min(candidates, key=lambda c: (abs(c - steps), -c))


def snap_tier(tier: TreeShape, candidates: Sequence[TreeShape]) -> TreeShape:
    """`tier` if a candidate, else the nearest by steps, a chain before a tree, ties to the
    larger: with [1, 3, 7, 4x4x16], 2 → 3, 5 → 4x4x16, 6x8x32 → 7."""
    if tier in candidates:
        return tier
    return min(candidates, key=lambda c: (abs(c.steps - tier.steps), not c.is_chain, -c.steps))


class GateConfig(Protocol):
    @property
    def candidate_steps(self) -> tuple[int, ...]: ...
    @property
    def tiers(self) -> tuple[TreeShape, ...]: ...
    @property
    def warmup_batches(self) -> int: ...
    @property
    def update_interval(self) -> int: ...


C = TypeVar("C", bound=GateConfig)


class GatedPolicy(Generic[C]):
    """What the built-in kinds share: their config, the tier, and the gate."""

    def __init__(self, config: C, initial: int | TreeShape) -> None:
        self.config = config
        self._tier = snap_tier(as_tier(initial), config.tiers)
        self._gate = DecisionGate(config.warmup_batches, config.update_interval)

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        return self.config.candidate_steps

    @property
    def candidate_tiers(self) -> tuple[TreeShape, ...]:
        return self.config.tiers

    @property
    def current_steps(self) -> int:
        return self._tier.steps

    @property
    def current_tier(self) -> TreeShape:
        return self._tier

    @property
    def count(self) -> int:
        """Rounds counted toward the gate."""
        return self._gate.count

    def _swap_config(self, config: C) -> bool:
        """Takes `config`; the tier snaps to its candidates. True if the tier changed."""
        old = self._tier
        self.config = config
        self._gate.retune(config.warmup_batches, config.update_interval)
        self._tier = snap_tier(old, config.tiers)
        return self._tier != old
