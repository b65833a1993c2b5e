"""AdaptiveController: each target's WatchRounds → its policy → ApplyTier; pin and reconnect."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from controller import memory
from controller.bands import PolicySpec
from controller.interface import (
    PerRequestPolicy,
    RoundSample,
    SpeculationPolicy,
    as_tier,
    policy_regimes,
    policy_tier,
)
from controller.policy import PolicyConfig
from controller.target_link import NotConnectedError, TargetLink
from specpair.client.results import TargetState, TierSwitch
from specpair.config import ControllerConfig
from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.proto.v1 import target_pb2
from specpair.runtime.round import RoundStats
from specpair.runtime.shape import ShapeError, TreeShape, tier_from_wire, tier_name
from specpair.tiers import RegimeSteps

log = get_logger("controller")

RECENT_SWITCHES = 32
RECENT_PREDRAFTS = 256  # request-rounds behind the hit rate in GetState


@dataclass(slots=True)
class _Target:
    address: str
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
    pipelined: bool = False  # its last round was
    # Recent pipelined request-rounds: was the tree pre-drafted?
    predrafted: deque[bool] = field(default_factory=lambda: deque(maxlen=RECENT_PREDRAFTS))


class AdaptiveController:
    """Runs one policy per target and keeps every target at the pinned or the policy's tier."""

    def __init__(
        self,
        config: ControllerConfig,
        policy: PolicySpec | PolicyConfig,
        *,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or ServiceMetrics("controller")
        saved = memory.load(config.state_file) if config.state_file else memory.Memory()
        # What the operator changed live outlasts the policy file the controller started with.
        if isinstance(policy, PolicyConfig):
            policy = PolicySpec.of(policy)
        self.policy = PolicySpec.from_mapping(saved.policy) if saved.policy else policy
        self.pinned: TreeShape | None = saved.pinned
        self._remembered = saved.targets
        if config.state_file and (saved.pinned is not None or saved.targets):
            log.info("state restored", path=str(config.state_file), pinned=str(saved.pinned))
        self._targets = [_Target(address) for address in config.targets]
        for t in self._targets:
            t.link = TargetLink(
                t.address,
                on_connect=functools.partial(self._connect, t),
                on_round=functools.partial(self._on_round, t),
                on_lost=functools.partial(self._lost, t),
                tls=config.server.tls,
                token=config.server.ops_token,
                backoff_max_s=config.reconnect_s,
            )

    @property
    def pinned_steps(self) -> int | None:
        return None if self.pinned is None else self.pinned.steps

    async def start(self) -> None:
        for t in self._targets:
            assert t.link is not None
            t.link.start()

    async def stop(self) -> None:
        for t in self._targets:
            if t.link is not None:
                await t.link.close()
        self._save()

    def _save(self) -> None:
        if self.config.state_file is None:
            return
        targets = dict(self._remembered)
        for t in self._targets:
            if t.policy is not None:
                targets[t.address] = memory.TargetMemory(
                    policy_tier(t.policy), t.policy.ema, t.policy.count
                )
        state = memory.Memory(self.pinned, self.policy.to_dict(), targets)
        try:
            memory.save(self.config.state_file, state)
        except OSError as exc:  # a full disk costs the memory, not the serving
            log.warning(
                "cannot save controller state", path=str(self.config.state_file), error=str(exc)
            )

    def snapshot(self) -> list[TargetState]:
        return [
            TargetState(
                target_address=t.address,
                connected=t.connected,
                active_steps=t.active.steps,
                ema=t.policy.ema if t.policy else 0.0,
                pinned_steps=self.pinned_steps,
                rounds_seen=t.rounds_seen,
                batches_counted=t.policy.count if t.policy else 0,
                recent_switches=tuple(t.switches),
                estimates=t.policy.estimates() if t.policy else (),
                model=t.policy.describe() if t.policy else "",
                pipeline=t.pipelined,
                pipeline_hit_rate=sum(t.predrafted) / len(t.predrafted) if t.predrafted else 0.0,
                active_shape=tier_name(t.active),
                pinned_shape=tier_name(self.pinned) if self.pinned else "",
            )
            for t in self._targets
        ]

    # --- ops ---------------------------------------------------------------------------------

    async def update_policy(self, **changes: Any) -> PolicySpec:
        """Validates and swaps in a partial update; ValueError names the bad field."""
        new = self.policy.replace_partial(**changes)
        tiers = new.candidate_tiers
        if self.pinned is not None and self.pinned not in tiers:
            raise ValueError(
                f"candidate_steps and tree_shapes {_names(tiers)} must include the pinned tier "
                f"{self.pinned} (unpin first)"
            )
        for t in self._targets:
            # A tier the target has not built would make every ApplyTier fail later.
            missing = set(tiers) - set(t.target_candidates or tiers)
            if missing:
                field = "tree_shapes" if all(not m.is_chain for m in missing) else "candidate_steps"
                raise ValueError(
                    f"{field} {_names(missing)} are not tiers of target {t.address} "
                    f"(it has {_names(t.target_candidates)})"
                )
        old_kind, self.policy = self.policy.kind, new
        log.info("policy updated", policy=new.to_dict())
        self._save()
        for t in self._targets:
            async with t.lock:
                if t.policy is None:
                    continue
                if new.kind != old_kind:
                    # Another kind learns from scratch, starting where the target runs: at the
                    # pinned tier while one is pinned, not at the old kind's choice.
                    start = self.pinned
                    t.policy = new.build(policy_tier(t.policy) if start is None else start)
                    changed = policy_regimes(t.policy) is not None  # its regime tiers go out
                else:
                    changed = t.policy.reconfigure(new.policy_options())
                if changed and self.pinned is None:
                    await self._apply(t, policy_tier(t.policy), "policy")
        return new

    async def pin(self, tier: int | TreeShape) -> None:
        """Pins a chain (by its steps) or a tree shape; ValueError names the field."""
        tier = as_tier(tier)
        field = "speculative_num_steps" if tier.is_chain else "shape"
        if tier not in self.policy.candidate_tiers:
            raise ValueError(
                f"{field} {tier} is not a candidate tier {_names(self.policy.candidate_tiers)}"
            )
        for t in self._targets:
            if t.target_candidates and tier not in t.target_candidates:
                raise ValueError(
                    f"{field} {tier} is not a tier of target {t.address} "
                    f"(it has {_names(t.target_candidates)})"
                )
        self.pinned = tier
        log.info("tier pinned", tier=str(tier))
        self._save()
        for t in self._targets:
            async with t.lock:
                await self._apply(t, tier, "pin")

    async def unpin(self) -> None:
        self.pinned = None
        log.info("tier unpinned")
        self._save()
        for t in self._targets:
            async with t.lock:
                if t.policy is not None:
                    await self._apply(t, policy_tier(t.policy), "unpin")

    # --- per target --------------------------------------------------------------------------

    async def _connect(
        self, t: _Target, info: target_pb2.TargetServiceGetServerInfoResponse
    ) -> None:
        async with t.lock:
            active, built = target_tiers(info)
            t.active, t.target_candidates = active, built
            if not set(self.policy.candidate_tiers) <= set(built):
                log.warning(
                    "policy tiers missing on target",
                    target=t.address,
                    policy=_names(self.policy.candidate_tiers),
                    target_tiers=_names(built),
                )
            if t.policy is None:
                saved = self._remembered.get(t.address)
                t.policy = self.policy.build(saved.tier if saved else active)
                if saved:
                    t.policy.resume(saved.ema, saved.count)
            desired = policy_tier(t.policy) if self.pinned is None else self.pinned
            # Applied even when the target already runs `desired`: a restarted target comes back
            # at its configured tier, and the call proves that the target accepts our ops token
            # (GetServerInfo is not protected) before we report it connected.
            reason = "policy" if self.pinned is None else "pin"
            if t.ever_connected:
                reason = "reconnect"
            await self._apply(t, desired, reason, raise_errors=True)
            t.connected = t.ever_connected = True
        self.metrics.active_tier.set(t.active.steps)
        log.info(
            "target connected",
            target=t.address,
            tier=str(t.active),
            pinned=str(self.pinned),
            ema=round(t.policy.ema, 4),
        )

    def _lost(self, t: _Target) -> None:
        t.connected = False

    async def _on_round(self, t: _Target, stats: RoundStats) -> None:
        t.rounds_seen += 1
        if any(a < 0 for a in stats.accept_lengths):
            log.warning("round with negative accept lengths ignored", round_id=stats.round_id)
            return
        t.pipelined = stats.pipelined
        if stats.pipelined:
            t.predrafted.extend(stats.predrafted)
            t.predrafted.extend([False] * stats.predraft_misses)
        sample = round_sample(stats)
        for a in sample.accept_lengths:
            self.metrics.accept_length.observe(a)
        async with t.lock:
            assert t.policy is not None  # set by _connect before the stream starts
            # While pinned the policy keeps learning, but its decisions are not applied.
            changed = t.policy.observe(sample)
            if (regimes := policy_regimes(t.policy)) is not None and regimes != t.regimes:
                changed = True  # e.g. a regime first seen: its tier is now known
            if changed and self.pinned is None:
                await self._apply(t, policy_tier(t.policy), "policy")

    async def _apply(
        self, t: _Target, tier: TreeShape, reason: str, *, raise_errors: bool = False
    ) -> bool:
        """ApplyTier on `t` (caller holds t.lock); False if it is not connected or refused."""
        assert t.link is not None
        # A policy's per-request and per-regime tiers ride along, also when an unpin hands the
        # target back to it (else its first round runs without them, e.g. a sampled batch at
        # the greedy tier); a pin clears them.
        policy = t.policy if reason in ("policy", "unpin") else None
        own = policy.request_steps if isinstance(policy, PerRequestPolicy) else {}
        regimes = policy_regimes(policy) if policy is not None else None
        try:
            response = await t.link.apply_tier(tier, reason, own, regimes)
        except NotConnectedError:
            return False
        except grpc.aio.AioRpcError as exc:
            # A refused tier is a config mismatch worth logging, not a reason to reconnect.
            if raise_errors and exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            log.warning(
                "ApplyTier failed",
                target=t.address,
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
        previous, t.active = t.active, applied
        t.regimes = regimes
        self.metrics.active_tier.set(t.active.steps)
        if previous != t.active:
            ema = t.policy.ema if t.policy else 0.0
            t.switches.append(
                TierSwitch(
                    round_id=response.current_round,
                    from_steps=previous.steps,
                    to_steps=t.active.steps,
                    reason=reason,
                    ema=ema,
                    unix_time=time.time(),
                    from_shape=tier_name(previous),
                    to_shape=tier_name(t.active),
                )
            )
            self.metrics.tier_switches.inc()
            self._save()
            log.info(
                "tier switched",
                target=t.address,
                from_tier=str(previous),
                to_tier=str(t.active),
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


def _names(tiers: Iterable[TreeShape]) -> str:
    """ "[1, 3, 4x4x16]": chains by their steps, as a policy lists them."""
    return "[" + ", ".join(str(t) for t in sorted(tiers)) + "]"
