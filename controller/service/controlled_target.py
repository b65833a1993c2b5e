"""A target as the controller keeps it: its tiers and rounds read as the policies see them,
its state (a row of GetState), and the one way a tier is commanded to it (`apply`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from controller.policies.interface import (
    PerRequestPolicy,
    RoundSample,
    SpeculationPolicy,
    policy_regimes,
)
from controller.service.target_link import NotConnectedError, TargetLink
from specpair.logging import get_logger
from specpair.proto.v1 import target_pb2
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import ShapeError, TreeShape, tier_from_wire, tier_name
from specpair.target_state import TargetState, TierSwitch
from specpair.tier_estimate import RegimeSteps

log = get_logger("controller")

RECENT_SWITCHES = 32


@dataclass(slots=True)
class ControlledTarget:
    """One target of the controller: its link, its policy, the tier last commanded."""

    address: str
    metrics: ServiceMetrics
    on_switch: Callable[[], None]  # after each tier switch (the controller saves its state)
    connected: bool = False
    ever_connected: bool = False
    # The tier last commanded (or reported by GetServerInfo on connect); 0 before first contact.
    active: TreeShape = field(default_factory=lambda: TreeShape(0))
    # Created at first contact, from the tier the target reports (GetServerInfo).
    policy: SpeculationPolicy | None = None
    target_candidates: tuple[TreeShape, ...] = ()  # its chains and the trees it built
    regimes: RegimeSteps | None = None  # the per-regime tiers last sent
    link: TargetLink | None = None
    rounds_seen: int = 0
    switches: deque[TierSwitch] = field(default_factory=lambda: deque(maxlen=RECENT_SWITCHES))
    # Serializes ApplyTier between the round stream and the ops RPCs.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def state(self, pinned: TreeShape | None) -> TargetState:
        """Its row of GetState."""
        policy = self.policy
        return TargetState(
            target_address=self.address,
            connected=self.connected,
            active_steps=self.active.steps,
            ema=policy.ema if policy else 0.0,
            pinned_steps=None if pinned is None else pinned.steps,
            rounds_seen=self.rounds_seen,
            batches_counted=policy.count if policy else 0,
            recent_switches=tuple(self.switches),
            estimates=policy.estimates() if policy else (),
            model=policy.describe() if policy else "",
            active_shape=tier_name(self.active),
            pinned_shape=tier_name(pinned) if pinned else "",
        )

    async def apply(self, tier: TreeShape, reason: str, *, raise_errors: bool = False) -> bool:
        """ApplyTier (the caller holds `lock`); False if it is not connected or refused."""
        assert self.link is not None
        # A policy's per-request and per-regime tiers ride along, also when an unpin hands the
        # target back to it (else its first round runs without them, e.g. a sampled batch at
        # the greedy tier); a pin clears them.
        policy = self.policy if reason in ("policy", "unpin") else None
        own = policy.request_steps if isinstance(policy, PerRequestPolicy) else {}
        regimes = policy_regimes(policy) if policy is not None else None
        try:
            response = await self.link.apply_tier(tier, reason, own, regimes)
        except NotConnectedError:
            return False
        except grpc.aio.AioRpcError as exc:
            # A refused tier is a config mismatch worth logging, not a reason to reconnect.
            if raise_errors and exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            log.warning(
                "ApplyTier failed",
                target=self.address,
                tier=str(tier),
                reason=reason,
                code=exc.code().name,
                details=exc.details(),
            )
            return False
        # Switches are counted against the tier we last commanded: the target reports as
        # previous_steps the tier of its running round, which lags a command not yet started.
        try:
            applied = tier_from_wire(response.speculative_num_steps, response.shape, "shape")
        except ShapeError:
            applied = tier  # a reply we cannot read: the target accepted what we sent
        previous, self.active = self.active, applied
        self.regimes = regimes
        self.metrics.active_tier.set(self.active.steps)
        if previous != self.active:
            ema = self.policy.ema if self.policy else 0.0
            self.switches.append(
                TierSwitch(
                    round_id=response.current_round,
                    from_steps=previous.steps,
                    to_steps=self.active.steps,
                    reason=reason,
                    ema=ema,
                    unix_time=time.time(),
                    from_shape=tier_name(previous),
                    to_shape=tier_name(self.active),
                )
            )
            self.metrics.tier_switches.inc()
            self.on_switch()
            log.info(
                "tier switched",
                target=self.address,
                from_tier=str(previous),
                to_tier=str(self.active),
                reason=reason,
                ema=round(ema, 4),
                round_id=response.current_round,
            )
        return True


def round_sample(stats: RoundStats) -> RoundSample:
    """What a policy sees of a round: a round without drafts (the draft was away, or tier 0) is
    a tier-0 sample, whatever tier was active."""
    speculative = stats.speculative and bool(stats.accept_lengths)
    timings = stats.timings
    return RoundSample(
        steps=stats.speculative_num_steps if speculative else 0,
        batch_size=stats.batch_size,
        accept_lengths=stats.accept_lengths if speculative else (),
        request_ids=stats.request_ids if speculative else (),
        request_steps=stats.request_steps if speculative else (),
        plain_request_ids=stats.plain_request_ids,
        total_ms=timings.total_ms,
        verify_ms=timings.verify_ms,
        draft_ms=timings.draft_ms,
        schedule_ms=timings.schedule_ms,
        admit_ms=timings.admit_ms,
        sampled=stats.sampled_requests,
        shape=stats.shape if speculative else None,
    )


def target_tiers(
    info: target_pb2.TargetServiceGetServerInfoResponse,
) -> tuple[TreeShape, tuple[TreeShape, ...]]:
    """The tier a target runs and every tier it built (its chains and tree shapes); a shape
    it reports that is none is left out (logged): the policy's own is then refused."""
    try:
        active = tier_from_wire(info.speculative_num_steps, info.shape, "shape")
    except ShapeError:
        active = TreeShape(max(info.speculative_num_steps, 0))
    built = [TreeShape(s) for s in info.candidate_steps if s >= 0]
    for text in info.tree_shapes:
        try:
            built.append(TreeShape.parse(text))
        except ShapeError as exc:
            log.warning("target reports a shape that is none", shape=text, error=str(exc))
    return active, tuple(sorted(set(built)))


def tier_names(tiers: Iterable[TreeShape]) -> str:
    """ "[1, 3, 4x4x16]": chains by their steps, as a policy lists them."""
    return "[" + ", ".join(str(t) for t in sorted(tiers)) + "]"
