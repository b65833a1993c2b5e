"""Per-request tiers: each live request's own acceptance, one cost model, the batch's tokens/s.

A batch-wide acceptance average gives an easy request (code, greedy) and a hard one (prose
sampled at T = 1) the same tier. Here every request keeps its own `AcceptanceModel` (shrunk
toward the batch's pooled rate, so a newcomer starts as the batch does), and a decision picks a
tier per request to maximise the batch's predicted tokens per second

    tokens/s = Σ_r E_r(s_r) / T(s_1, …, s_b)

with T from `CostModel.mixed_round_ms` (the round at the largest tier m, the draft's work per
request). For each candidate m, requests start at m and each in turn takes the tier ≤ m that
raises the ratio most (two sweeps); the best m wins. Worked example, b = 2, T(3) = 40 ms with
a 2 ms step share: code at α = 0.9 (E(3) = 3.44) and prose at α = 0.1 (E(3) = 1.11, E(0) = 1)
→ both at 3: 4.55 / 40 ms = 114 tokens/s; prose at 0: 4.44 / (40 − 4 − 3) = 135 tokens/s.

Guards as the goodput kind's: warm-up and interval, and a new assignment must beat the current
one by `min_gain`. A request at tier 0 learns nothing, so after `probe_interval` rounds there
it runs the smallest positive tier for one interval. Loaded as a policy class:
`--policy-class controller.policies.request_tiers:RequestTiers` with the goodput kind's keys.
The batch tier sent (`current_steps`) is m: a request not yet seen runs there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controller.policies.goodput.acceptance import AcceptanceModel
from controller.policies.goodput.config import GoodputConfig
from controller.policies.goodput.policy import GoodputPolicy
from controller.policies.interface import GatedPolicy, RoundSample, TierEstimate
from specpair.capabilities import Modes, Policy, Tiers, check
from specpair.runtime.shape import TreeShape

SWEEPS = 2
REQUEST_PRIOR = 4.0  # pseudo-trials at the batch's pooled rate behind each request's estimate


class RequestTiers(GatedPolicy[GoodputConfig]):
    def __init__(self, options: Mapping[str, Any], initial_steps: int) -> None:
        super().__init__(chains_only(GoodputConfig.from_mapping(options)), initial_steps)
        self.batch = GoodputPolicy(self.config, initial_steps)  # pooled acceptance + cost
        self._own: dict[str, int] = {}  # request id → its tier, where not _steps
        self._models: dict[str, AcceptanceModel] = {}
        self._at_zero: dict[str, int] = {}  # rounds each request has spent at tier 0
        self._live: tuple[str, ...] = ()

    # ---- SpeculationPolicy ----------------------------------------------------------------

    @property
    def request_steps(self) -> Mapping[str, int]:
        return dict(self._own)

    @property
    def ema(self) -> float:
        return self.batch.ema

    def resume(self, ema: float, count: int) -> None:
        self._gate.count = max(int(count), 0)
        self.batch.resume(ema, count)

    def reconfigure(self, options: Mapping[str, Any]) -> bool:
        """New keys keep what was learnt; the batch tier snaps to the new candidates and a
        request whose tier is no longer one runs at it."""
        config = chains_only(GoodputConfig.from_mapping(options))
        self.batch.reconfigure(config)
        own = dict(self._own)
        self._own = {r: s for r, s in own.items() if s in config.candidate_steps}
        return self._swap_config(config) or self._own != own

    def estimates(self) -> tuple[TierEstimate, ...]:
        return self.batch.estimates()

    def describe(self) -> str:
        tiers = [self.tier_of(r) for r in self._live]
        mix = ", ".join(f"{tiers.count(s)}×{s}" for s in sorted(set(tiers), reverse=True))
        return f"per-request tiers [{mix or 'none'}] over {self.batch.describe()}"

    def observe(self, sample: RoundSample) -> bool:
        self.batch.observe(sample)
        self._live = (*sample.request_ids, *sample.plain_request_ids)
        for rid in set(self._models) - set(self._live):  # it left the batch
            self._models.pop(rid)
            self._own.pop(rid, None)
            self._at_zero.pop(rid, None)
        pooled = self.batch.acceptance.alpha
        for rid in self._live:
            model = self._models.setdefault(
                rid, AcceptanceModel(self.config.ema_alpha, prior=REQUEST_PRIOR)
            )
            model.prior_alpha = pooled
            self._at_zero[rid] = self._at_zero.get(rid, 0) + 1 if self.tier_of(rid) == 0 else 0
        per_request = (sample.request_ids, sample.accept_lengths, sample.request_steps)
        if len({len(x) for x in per_request}) == 1:  # an older target sends none of them
            for rid, a, s in zip(*per_request, strict=True):
                self._models[rid].observe(s, [a])
        return self._gate.tick() and self._decide()

    # ---- the decision -------------------------------------------------------------------

    def tier_of(self, request_id: str) -> int:
        return self._own.get(request_id, self.current_steps)

    def tokens_per_s(self, steps: Sequence[int]) -> float | None:
        """Predicted tokens/s of the live batch at `steps` (aligned with the live requests)."""
        gained = sum(
            self._models[r].tokens_per_round(s) for r, s in zip(self._live, steps, strict=True)
        )
        return self._rate(steps, gained)

    def _rate(self, steps: Sequence[int], gained: float) -> float | None:
        round_ms = self.batch.cost.mixed_round_ms(steps)
        return None if round_ms is None else 1e3 * gained / round_ms

    def _decide(self) -> bool:
        live = self._live
        if not live:
            return False
        positive = [s for s in self.candidate_steps if s > 0]
        probes = {r for r in live if self._at_zero.get(r, 0) >= self.config.probe_interval}
        # E_r(s) for every request and candidate, computed once per decision
        table = [
            {s: self._models[r].tokens_per_round(s) for s in self.candidate_steps} for r in live
        ]
        best: tuple[float, list[int]] | None = None
        for m in self.candidate_steps:
            steps = self._best_under(m, probes, positive, table)
            rate = self._rate(steps, sum(e[s] for e, s in zip(table, steps, strict=True)))
            if rate is not None and (best is None or rate > best[0]):
                best = (rate, steps)
        current = [self.tier_of(r) for r in live]
        now = self.tokens_per_s(current)
        if best is None or (
            now is not None and best[0] <= now * (1.0 + self.config.min_gain) and not probes
        ):
            return False
        return self._take(best[1])

    def _best_under(
        self, m: int, probes: set[str], positive: list[int], table: list[dict[int, float]]
    ) -> list[int]:
        """Each request's tier ≤ m, by coordinate ascent from all at m; a request too long at
        tier 0 (`probes`) gets the smallest positive tier instead, if m allows one."""
        steps = [m] * len(self._live)
        gained = sum(e[m] for e in table)
        floor = positive[0] if positive and positive[0] <= m else 0
        below = [s for s in self.candidate_steps if s <= m]
        for _ in range(SWEEPS):
            for i, rid in enumerate(self._live):
                base = gained - table[i][steps[i]]
                scored = []
                for s in [floor] if rid in probes else below:
                    steps[i] = s
                    scored.append((self._rate(steps, base + table[i][s]) or 0.0, -s, s))
                steps[i] = max(scored)[2]
                gained = base + table[i][steps[i]]
        return steps

    def _take(self, steps: Sequence[int]) -> bool:
        old = (self.current_steps, dict(self._own))
        self._tier = TreeShape(max(steps))
        m = self.current_steps
        self._own = {r: s for r, s in zip(self._live, steps, strict=True) if s != m}
        for r, s in zip(self._live, steps, strict=True):
            if s > 0:
                self._at_zero[r] = 0
        return (self.current_steps, self._own) != old


def chains_only(config: GoodputConfig) -> GoodputConfig:
    """Per-request tiers are chains (ApplyTier's request_steps): tree shapes are refused."""
    check(Modes(policy=Policy.REQUEST, tiers=Tiers.of(config.tree_shapes)))
    return config
