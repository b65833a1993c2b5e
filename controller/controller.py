"""AdaptiveController: each target's WatchRounds → its policy → ApplyTier; pin and reconnect."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc

from controller import memory
from controller.bands import PolicySpec
from controller.interface import PerRequestPolicy, RegimePolicy, RoundSample, SpeculationPolicy
from controller.policy import PolicyConfig
from controller.target_link import NotConnectedError, TargetLink
from specpair.client.results import TargetState, TierSwitch
from specpair.config import ControllerConfig
from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.proto.v1 import target_pb2
from specpair.runtime.round import RoundStats
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
    active_steps: int = 0
    # Created at first contact, from the tier the target reports (GetServerInfo).
    policy: SpeculationPolicy | None = None
    target_candidates: tuple[int, ...] = ()
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
        self.pinned_steps: int | None = saved.pinned_steps
        self._remembered = saved.targets
        if config.state_file and (saved.pinned_steps is not None or saved.targets):
            log.info("state restored", path=str(config.state_file), pinned=saved.pinned_steps)
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
                    t.policy.current_steps, t.policy.ema, t.policy.count
                )
        state = memory.Memory(self.pinned_steps, self.policy.to_dict(), targets)
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
                active_steps=t.active_steps,
                ema=t.policy.ema if t.policy else 0.0,
                pinned_steps=self.pinned_steps,
                rounds_seen=t.rounds_seen,
                batches_counted=t.policy.count if t.policy else 0,
                recent_switches=tuple(t.switches),
                estimates=t.policy.estimates() if t.policy else (),
                model=t.policy.describe() if t.policy else "",
                pipeline=t.pipelined,
                pipeline_hit_rate=sum(t.predrafted) / len(t.predrafted) if t.predrafted else 0.0,
            )
            for t in self._targets
        ]

    # --- ops ---------------------------------------------------------------------------------

    async def update_policy(self, **changes: Any) -> PolicySpec:
        """Validates and swaps in a partial update; ValueError names the bad field."""
        new = self.policy.replace_partial(**changes)
        if self.pinned_steps is not None and self.pinned_steps not in new.candidate_steps:
            raise ValueError(
                f"candidate_steps {list(new.candidate_steps)} must include the pinned tier "
                f"{self.pinned_steps} (unpin first)"
            )
        for t in self._targets:
            # A tier the target has not built would make every ApplyTier fail later.
            missing = set(new.candidate_steps) - set(t.target_candidates or new.candidate_steps)
            if missing:
                raise ValueError(
                    f"candidate_steps {sorted(missing)} are not tiers of target {t.address} "
                    f"(it has {list(t.target_candidates)})"
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
                    start = self.pinned_steps
                    t.policy = new.build(t.policy.current_steps if start is None else start)
                    changed = isinstance(t.policy, RegimePolicy)  # its regime tiers go out
                else:
                    changed = t.policy.reconfigure(new.policy_options())
                if changed and self.pinned_steps is None:
                    await self._apply(t, t.policy.current_steps, "policy")
        return new

    async def pin(self, steps: int) -> None:
        if steps not in self.policy.candidate_steps:
            raise ValueError(
                f"speculative_num_steps {steps} is not a candidate tier "
                f"{list(self.policy.candidate_steps)}"
            )
        for t in self._targets:
            if t.target_candidates and steps not in t.target_candidates:
                raise ValueError(
                    f"speculative_num_steps {steps} is not a tier of target {t.address} "
                    f"(it has {list(t.target_candidates)})"
                )
        self.pinned_steps = steps
        log.info("tier pinned", steps=steps)
        self._save()
        for t in self._targets:
            async with t.lock:
                await self._apply(t, steps, "pin")

    async def unpin(self) -> None:
        self.pinned_steps = None
        log.info("tier unpinned")
        self._save()
        for t in self._targets:
            async with t.lock:
                if t.policy is not None:
                    await self._apply(t, t.policy.current_steps, "unpin")

    # --- per target --------------------------------------------------------------------------

    async def _connect(
        self, t: _Target, info: target_pb2.TargetServiceGetServerInfoResponse
    ) -> None:
        async with t.lock:
            t.active_steps = info.speculative_num_steps
            t.target_candidates = tuple(info.candidate_steps)
            if not set(self.policy.candidate_steps) <= set(t.target_candidates or ()):
                log.warning(
                    "policy tiers missing on target",
                    target=t.address,
                    policy=list(self.policy.candidate_steps),
                    target_tiers=list(t.target_candidates),
                )
            if t.policy is None:
                saved = self._remembered.get(t.address)
                steps = saved.steps if saved else info.speculative_num_steps
                t.policy = self.policy.build(steps)
                if saved:
                    t.policy.resume(saved.ema, saved.count)
            desired = t.policy.current_steps if self.pinned_steps is None else self.pinned_steps
            # Applied even when the target already runs `desired`: a restarted target comes back
            # at its configured tier, and the call proves that the target accepts our ops token
            # (GetServerInfo is not protected) before we report it connected.
            reason = "policy" if self.pinned_steps is None else "pin"
            if t.ever_connected:
                reason = "reconnect"
            await self._apply(t, desired, reason, raise_errors=True)
            t.connected = t.ever_connected = True
        self.metrics.active_tier.set(t.active_steps)
        log.info(
            "target connected",
            target=t.address,
            steps=t.active_steps,
            pinned=self.pinned_steps,
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
            if isinstance(t.policy, RegimePolicy) and t.policy.regime_steps != t.regimes:
                changed = True  # e.g. a regime first seen: its tier is now known
            if changed and self.pinned_steps is None:
                await self._apply(t, t.policy.current_steps, "policy")

    async def _apply(
        self, t: _Target, steps: int, reason: str, *, raise_errors: bool = False
    ) -> bool:
        """ApplyTier on `t` (caller holds t.lock); False if it is not connected or refused."""
        assert t.link is not None
        # A policy's per-request and per-regime tiers ride along, also when an unpin hands the
        # target back to it (else its first round runs without them, e.g. a sampled batch at
        # the greedy tier); a pin clears them.
        policy = t.policy if reason in ("policy", "unpin") else None
        own = policy.request_steps if isinstance(policy, PerRequestPolicy) else {}
        regimes = policy.regime_steps if isinstance(policy, RegimePolicy) else None
        try:
            response = await t.link.apply_tier(steps, reason, own, regimes)
        except NotConnectedError:
            return False
        except grpc.aio.AioRpcError as exc:
            # A refused tier is a config mismatch worth logging, not a reason to reconnect.
            if raise_errors and exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            log.warning(
                "ApplyTier failed",
                target=t.address,
                steps=steps,
                reason=reason,
                code=exc.code().name,
                details=exc.details(),
            )
            return False
        # Switches are counted against the tier we last commanded: the target reports as
        # previous_steps the tier of its running round, which lags a command not yet started.
        previous, t.active_steps = t.active_steps, response.speculative_num_steps
        t.regimes = regimes
        self.metrics.active_tier.set(t.active_steps)
        if previous != t.active_steps:
            ema = t.policy.ema if t.policy else 0.0
            t.switches.append(
                TierSwitch(
                    round_id=response.current_round,
                    from_steps=previous,
                    to_steps=t.active_steps,
                    reason=reason,
                    ema=ema,
                    unix_time=time.time(),
                )
            )
            self.metrics.tier_switches.inc()
            self._save()
            log.info(
                "tier switched",
                target=t.address,
                from_steps=previous,
                to_steps=t.active_steps,
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
    )
