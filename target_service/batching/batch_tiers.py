"""The target's tiers: the batch's, and each request's where the controller set its own.

A tier is a `TreeShape`: a chain (the int tiers of `candidate_steps`) or a tree (`tree_shapes`).
A command is checked when it arrives (`ask`: every tier must be a candidate, so a state was
built for it) and lands when the next round starts (`switch`), never inside one: both are
reference swaps to states built at start-up. A request the controller did not name runs at the
batch tier — its sampling regime's, where the controller set one per regime (`RegimeSteps`): a
batch that turns sampled runs at the sampled tier from its first round, with no round trip to
the controller; a finished request's entry goes (`forget`). A round runs at the largest of its
requests' tiers (`TreeShape` order: steps first), each request capped at its own tier's steps.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from specpair.logging import get_logger
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps

log = get_logger(__name__)


class Tiers:
    def __init__(
        self, candidates: Collection[TreeShape], initial: TreeShape, metrics: ServiceMetrics
    ) -> None:
        self.candidates = sorted(candidates)
        self.batch = initial
        self.own: dict[str, TreeShape] = {}  # request id → its own tier, where set
        self.regimes: RegimeSteps | None = None  # the batch tier per regime, where set
        self.metrics = metrics
        self._pending: tuple[TreeShape, str, dict[str, TreeShape], RegimeSteps | None] | None = None
        metrics.active_tier.set(initial.steps)

    def ask(
        self,
        tier: TreeShape,
        reason: str,
        request_steps: Mapping[str, TreeShape] | None = None,
        regimes: RegimeSteps | None = None,
    ) -> TreeShape:
        """Queues a switch for the next round, with per-request tiers and per-regime batch tiers
        that replace the previous ones (ids not running are ignored); returns the batch tier
        active now."""
        asked = {"speculative_num_steps": tier}
        asked.update({f"request_steps[{r}]": s for r, s in (request_steps or {}).items()})
        if regimes is not None:
            asked.update(greedy_steps=regimes.greedy, sampled_steps=regimes.sampled)
        for name, shape in asked.items():
            if shape not in self.candidates:
                names = [str(c) for c in self.candidates]
                raise ValueError(f"{name} {shape} is not a candidate tier {names}")
        self._pending = (tier, reason, dict(request_steps or {}), regimes)
        return self.batch

    def switch(self, round_id: int, running: Collection[str]) -> None:
        """Applies the last command asked for, if any (at a round boundary). Its per-request
        tiers keep only the `running` ids: a request may finish between the controller's
        command and this round (and `forget` has already run for it)."""
        if self._pending is None:
            return
        tier, reason, own, self.regimes = self._pending
        self.own = {rid: shape for rid, shape in own.items() if rid in running}
        self._pending = None
        if tier != self.batch:
            frm, to = str(self.batch), str(tier)
            log.info("tier switch", round_id=round_id, frm=frm, to=to, reason=reason)
            self.batch = tier
            self.metrics.active_tier.set(tier.steps)
            self.metrics.tier_switches.inc()

    def of(self, request_ids: Sequence[str], sampled: bool = False) -> list[TreeShape]:
        """Each request's tier for the round starting now; `sampled`: some request of the
        batch samples."""
        batch = self.batch if self.regimes is None else self.regimes.of(sampled)
        return [self.own.get(rid, batch) for rid in request_ids]

    def forget(self, request_id: str) -> None:
        self.own.pop(request_id, None)
