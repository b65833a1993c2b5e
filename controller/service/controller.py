"""AdaptiveController: each target's WatchRounds → its policy → ApplyTier; pin and reconnect;
the ops surface. What it keeps of each target, and ApplyTier itself: controlled_target.py."""

from __future__ import annotations

import functools
from typing import Any

from controller.policies.bands import PolicySpec
from controller.policies.interface import as_tier, policy_regimes, policy_tier
from controller.policies.sglang import PolicyConfig
from controller.service import memory
from controller.service.controlled_target import (
    ControlledTarget,
    round_sample,
    target_tiers,
    tier_names,
)
from controller.service.target_link import TargetLink
from specpair.config import ControllerConfig
from specpair.logging import get_logger
from specpair.proto.v1 import target_pb2
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import TreeShape
from specpair.target_state import TargetState

log = get_logger("controller")


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
        self._targets = [
            ControlledTarget(address, self.metrics, self._save) for address in config.targets
        ]
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
        return [t.state(self.pinned) for t in self._targets]

    # --- ops ---------------------------------------------------------------------------------

    async def update_policy(self, **changes: Any) -> PolicySpec:
        """Validates and swaps in a partial update; ValueError names the bad field."""
        new = self.policy.replace_partial(**changes)
        tiers = new.candidate_tiers
        if self.pinned is not None and self.pinned not in tiers:
            raise ValueError(
                f"candidate_steps and tree_shapes {tier_names(tiers)} must include the pinned tier "
                f"{self.pinned} (unpin first)"
            )
        for t in self._targets:
            # A tier the target has not built would make every ApplyTier fail later.
            missing = set(tiers) - set(t.target_candidates or tiers)
            if missing:
                field = "tree_shapes" if all(not m.is_chain for m in missing) else "candidate_steps"
                raise ValueError(
                    f"{field} {tier_names(missing)} are not tiers of target {t.address} "
                    f"(it has {tier_names(t.target_candidates)})"
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
                    await t.apply(policy_tier(t.policy), "policy")
        return new

    async def pin(self, tier: int | TreeShape) -> None:
        """Pins a chain (by its steps) or a tree shape; ValueError names the field."""
        tier = as_tier(tier)
        field = "speculative_num_steps" if tier.is_chain else "shape"
        if tier not in self.policy.candidate_tiers:
            raise ValueError(self._not_a_candidate(field, tier))
        for t in self._targets:
            if t.target_candidates and tier not in t.target_candidates:
                raise ValueError(
                    f"{field} {tier} is not a tier of target {t.address} "
                    f"(it has {tier_names(t.target_candidates)})"
                )
        self.pinned = tier
        log.info("tier pinned", tier=str(tier))
        self._save()
        for t in self._targets:
            async with t.lock:
                await t.apply(tier, "pin")

    def _not_a_candidate(self, field: str, tier: TreeShape) -> str:
        """Why the policy cannot pin `tier`, and what would let it."""
        tiers = tier_names(self.policy.candidate_tiers)
        if tier.is_chain:
            return f"{field} {tier} is not a candidate tier {tiers}"
        if self.policy.kind != "goodput":
            return (
                f"{field} {tier}: the {self.policy.kind} policy chooses among chains only "
                f"{tiers}; a tree shape is pinned under the goodput kind, listed in its "
                f"tree_shapes: specpair ctl policy kind=goodput tree_shapes={tier}, then pin it"
            )
        return (
            f"{field} {tier} is not among the policy's tree_shapes {tiers}: specpair ctl "
            f"policy tree_shapes={tier} (beside any it lists), then pin it"
        )

    async def unpin(self) -> None:
        self.pinned = None
        log.info("tier unpinned")
        self._save()
        for t in self._targets:
            async with t.lock:
                if t.policy is not None:
                    await t.apply(policy_tier(t.policy), "unpin")

    # --- per target --------------------------------------------------------------------------

    async def _connect(
        self, t: ControlledTarget, info: target_pb2.TargetServiceGetServerInfoResponse
    ) -> None:
        async with t.lock:
            active, built = target_tiers(info)
            t.active, t.target_candidates = active, built
            if not set(self.policy.candidate_tiers) <= set(built):
                log.warning(
                    "policy tiers missing on target",
                    target=t.address,
                    policy=tier_names(self.policy.candidate_tiers),
                    target_tiers=tier_names(built),
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
            await t.apply(desired, reason, raise_errors=True)
            t.connected = t.ever_connected = True
        self.metrics.active_tier.set(t.active.steps)
        log.info(
            "target connected",
            target=t.address,
            tier=str(t.active),
            pinned=str(self.pinned),
            ema=round(t.policy.ema, 4),
        )

    def _lost(self, t: ControlledTarget) -> None:
        t.connected = False

    async def _on_round(self, t: ControlledTarget, stats: RoundStats) -> None:
        t.rounds_seen += 1
        if any(a < 0 for a in stats.accept_lengths):
            log.warning("round with negative accept lengths ignored", round_id=stats.round_id)
            return
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
                await t.apply(policy_tier(t.policy), "policy")
