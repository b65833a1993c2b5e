"""The goodput policy: the tier with the most expected tokens per second, tier 0 included.

For each candidate tier s at the current batch size b the policy predicts

    tokens/s(s) = b · E[tokens per round](s) / T(s, b)

from an acceptance model (E, per-position acceptance learnt from accept lengths:
acceptance.py) and a cost model (T, round time per tier and batch size, profiled at
start-up and learnt from the rounds' timings: cost.py). E.g. α = 0.6 → E = 1.6, 2.18,
2.46 at tiers 1, 3, 7; with T = 22, 30, 38 ms and T(0) = 20 ms at batch 1 that is 72.7, 72.5,
64.7 and 50 tokens/s: tier 1 (but by 0.3 %, inside the default margin: from tier 3 the policy
would stay).

Guards, shared with the sglang kind: no decision in the first `warmup_batches` rounds, then one
every `update_interval` rounds; a move needs a predicted gain over the current tier of more than
`min_gain` (5 %: bursty acceptance must not flip a near tie between two tiers). At tier 0
nothing is learnt about drafts, so now and then the policy probes a positive tier, paced by
rounds and by what probes cost, backing off while they fail (probe.py).

Two regimes, learnt apart: greedy batches and batches where some request samples. They differ
in both models — a sampled round costs more (the warps, the draft's q on the wire) and accepts
less (e.g. 1.1 of 3 drafts for prose at T = 1 against 1.8 for code greedy) — so one model fed
both predicts neither. The regime is
known from the round itself (`RoundSample.sampled`). Each regime resumes at the tier it left
off at — a regime never seen at the best its start-up profile predicts, else at the starting
tier — and the target is told both (`regime_steps`), so a batch that changes regime runs at its
tier from the first round; the policy then decides at once from what that regime taught before.

A prediction is only as good as what it extrapolates from: a tier never measured in this
batch bucket and regime whose predicted tokens/s is within `explore_margin` of the best is
tried (for one interval) before the policy settles, so that a stage model that mispredicts
it — e.g. verify held flat when only one tier was measured — cannot hide a better tier. Once
settled, the runner-up is re-measured now and then (probe.py): what a tier measured in
its first rounds would otherwise stand for good once another looks better.
"""

from __future__ import annotations

from controller.policies.goodput.acceptance import AcceptanceModel
from controller.policies.goodput.config import GoodputConfig, Regime
from controller.policies.goodput.cost import CostModel, batch_bucket, tier_estimates
from controller.policies.goodput.probe import (
    PROBE_MEMORY,
    REMEASURE_REQUEST_ROUNDS,
    could_pay,
    probe_cost,
    probe_paid_for,
    rank,
    remeasure_due,
    runner_up,
    start_remeasure,
)
from controller.policies.goodput.report import description
from controller.policies.interface import GatedPolicy, RoundSample, TierEstimate, snap_tier
from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps


class GoodputPolicy(GatedPolicy[GoodputConfig]):
    """Chooses the tier with the highest predicted tokens/s; see the module docstring."""

    def __init__(self, config: GoodputConfig, initial: int | TreeShape) -> None:
        super().__init__(config, initial)  # counts every round, tier 0's included
        self._start = self._tier
        self._regimes = {
            False: Regime.fresh(config, config.profile_ms),
            True: Regime.fresh(config, config.sampled_profile_ms),
        }
        self._sampled = False  # the regime of the last round
        self._batch = 1
        self._rounds_at_zero = 0
        self._zero_ms = 0.0  # the time of those rounds
        self._last_steps = self._tier.steps  # the tier the last round ran at
        self._probe_rounds: int | None = None  # rounds with drafts so far while probing
        self._probe_ms = 0.0  # their time
        self._explored: set[tuple[bool, int, TreeShape]] = set()  # (sampled, bucket, tier)
        self._stay = 0  # rounds since the tier last changed
        self._remeasured: TreeShape | None = None  # the tier left to re-measure the runner-up
        self._remeasure_requests = 0  # request-rounds with drafts at the runner-up's tier

    @property
    def regime(self) -> Regime:
        return self._regimes[self._sampled]

    @property
    def acceptance(self) -> AcceptanceModel:
        return self.regime.acceptance

    @property
    def cost(self) -> CostModel:
        return self.regime.cost

    @property
    def ema(self) -> float:
        """Predicted accepted drafts per request per round at the current tier."""
        return self.regime.tokens_per_round(self._tier) - 1.0

    @property
    def probing(self) -> bool:
        return self._probe_rounds is not None

    def resume(self, ema: float, count: int) -> None:
        # The models are relearnt in a few rounds; the count keeps the warm-up from repeating.
        self._gate.count = max(int(count), 0)

    def reconfigure(self, config: GoodputConfig) -> bool:
        """New guards and candidates keep the learnt models; a new profile reseeds its regime's
        cost."""
        for sampled, profile, before in (
            (False, config.profile_ms, self.config.profile_ms),
            (True, config.sampled_profile_ms, self.config.sampled_profile_ms),
        ):
            if profile != before:
                self._regimes[sampled].cost = CostModel(config.ema_alpha, profile)
        for regime in self._regimes.values():
            regime.acceptance.decay = config.acceptance_decay
            regime.cost.alpha = config.ema_alpha
            if regime.tier is not None:  # where it resumes must stay a tier the target has
                regime.tier = snap_tier(regime.tier, config.tiers)
        return self._swap_config(config)

    def observe(self, sample: RoundSample) -> bool:
        old = self._tier
        changed_regime = (sample.sampled > 0) != self._sampled
        if changed_regime:
            # Where the target ran this round (`regime_steps`), from what was known before it.
            self._regimes[self._sampled].tier = old
            self._sampled = not self._sampled
            self._tier = self._regime_start(self._sampled)
            self._probe_rounds, self._rounds_at_zero, self._zero_ms = None, 0, 0.0
            self._stay, self._remeasured, self._remeasure_requests = 0, None, 0
        regime = self.regime
        self._stay += 1
        if not (sample.steps > 0 and self._last_steps == 0):
            # The first round with drafts after rounds without: the draft extends every token
            # it missed first, several times a round's cost; learnt as the tier's, it would keep
            # the policy at tier 0 for good. What it costs is the catch-up's, not the tier's.
            regime.cost.observe(sample)
        self._last_steps = sample.steps
        regime.observe(sample)
        regime.rounds += 1
        self._batch = sample.batch_size
        if self._remeasured is not None and sample.speculative and sample.tier == self._tier:
            self._remeasure_requests += len(sample.accept_lengths)
        if self._probe_rounds is not None and sample.speculative:
            self._probe_rounds += 1
            self._probe_ms += sample.total_ms
        elif self._tier.steps == 0:
            self._rounds_at_zero += 1
            self._zero_ms += sample.total_ms
        due = self._gate.tick()
        if changed_regime:
            # Decided at once from what this regime taught before (a regime never seen, or seen
            # only at tier 0 and now at a positive tier, learns first).
            learnt = regime.rounds > self.config.warmup_batches + 1
            if learnt and (self._tier.steps == 0 or regime.acceptance.trials > 0):
                self._decide()
            return self._tier != old
        return due and self._decide()

    @property
    def regime_steps(self) -> RegimeSteps:
        """The tier for each regime: the current one's, and where the other left off (or where
        it would start). The target runs a batch that changes regime at its regime's tier from
        the first round; the decision below follows a round or more later."""
        other = self._regime_start(not self._sampled)
        greedy, sampled = (other, self._tier) if self._sampled else (self._tier, other)
        return RegimeSteps(greedy=greedy, sampled=sampled)

    def _regime_start(self, sampled: bool) -> TreeShape:
        """Where regime `sampled` starts: where it left off; never seen, the best its profile
        predicts (with the prior acceptance), else the starting tier."""
        regime = self._regimes[sampled]
        if regime.tier is not None:
            return regime.tier
        b = self._batch
        rates = {t: r for t in self.config.tiers if (r := regime.tokens_per_s(t, b))}
        if rates:
            return max(rates, key=lambda t: rank(t, rates[t]))
        positive = [t for t in self.config.tiers if t.steps > 0]
        return self._start if self._start.steps > 0 else (positive or [TreeShape(0)])[0]

    def tokens_per_s(self, steps: int | TreeShape, batch_size: int | None = None) -> float | None:
        return self.regime.tokens_per_s(steps, batch_size or self._batch)

    def _decide(self) -> bool:
        """One decision, its rules in order; True where the tier changed."""
        old, probed = self._tier, self.probing
        # 1. A re-measure of the runner-up runs until it can be judged; then the runner-up must
        #    earn its way off the tier it left, as any move must earn it off the current tier.
        if self._remeasured is not None and not self._remeasure_judged():
            return False
        remeasured, self._remeasured = self._remeasured, None
        baseline = old if remeasured is None else remeasured
        # 2. A probe runs its rounds, then must earn its way off tier 0.
        probe_ms = 0.0
        if probed:
            if not self._probe_judged():
                return False
            probe_ms, baseline = self._end_probe(), TreeShape(0)
        # 3. Long enough at tier 0, the smallest positive tier that could pay is probed.
        elif (probe := self._probe_due()) is not None:
            self._start_probe(probe)
            return True
        # 4. The tier with the most predicted tokens/s, once the baseline has an estimate.
        rates = {t: r for t in self.config.tiers if (r := self.tokens_per_s(t))}
        if not rates:
            return False
        if baseline not in rates and baseline.steps > 0 and not probed:
            return False  # no estimate of the current tier yet: learn it before comparing
        self._tier = self._choose(rates, baseline)
        # 5. What the decision taught: the time at tier 0 restarts on arriving there; a judged
        #    runner-up waits longer for its next re-measure if it lost; a positive tier kept
        #    hands a runner-up whose wait is over one re-measure; a probe that failed backs off.
        if self._tier == TreeShape(0) and old != TreeShape(0):
            self._rounds_at_zero, self._zero_ms = 0, 0.0
        if remeasured is not None:  # `old` is the runner-up: it kept its place or lost it
            self._judge_remeasure(old, lost=self._tier != old)
        elif self._tier == old and old.steps > 0 and not probed:
            self._remeasure(rates)
        if self._tier != old:
            self._stay = 0
        if probed:
            self._judge_probe(probe_ms, failed=self._tier == TreeShape(0))
        return self._tier != old

    def _choose(self, rates: dict[TreeShape, float], baseline: TreeShape) -> TreeShape:
        """A close tier never tried here first (`_young`), else the best where it beats
        `baseline` by more than `min_gain` (or `baseline` has no estimate), else `baseline`."""
        best = max(rates, key=lambda t: rank(t, rates[t]))
        base_rate = rates.get(baseline)
        if (young := self._young(rates, best)) is not None:
            return young
        if base_rate is None or rates[best] > base_rate * (1.0 + self.config.min_gain):
            return best
        return baseline

    def _probe_judged(self) -> bool:
        """Whether the probe has run its `probe_rounds` rounds with drafts."""
        return self._probe_rounds is not None and self._probe_rounds >= self.config.probe_rounds

    def _end_probe(self) -> float:
        """Ends the probe; what its rounds cost beyond as many at tier 0."""
        rounds, self._probe_rounds = self._probe_rounds or 0, None
        return probe_cost(self.cost, self._batch, rounds, self._probe_ms)

    def _probe_due(self) -> TreeShape | None:
        """The tier to probe: at tier 0 for `probe_every` rounds, the smallest positive tier
        that could pay by `min_gain`, where the time at tier 0 pays for its probe."""
        if self._tier != TreeShape(0) or self._rounds_at_zero < self.regime.probe_every:
            return None
        min_gain, b = self.config.min_gain, self._batch
        positive = [
            t for t in self.config.tiers if t.steps > 0 and could_pay(self.cost, t, b, min_gain)
        ]
        if positive and probe_paid_for(self.regime, self.config, positive[0], b, self._zero_ms):
            return positive[0]
        return None

    def _start_probe(self, tier: TreeShape) -> None:
        self._rounds_at_zero, self._zero_ms = 0, 0.0
        self._tier, self._probe_rounds, self._probe_ms = tier, 0, 0.0
        self._stay = 0
        # The probe's own rounds decide: the long acceptance window would otherwise let what
        # made the policy leave (say 30 rejections) outvote them for good.
        self.acceptance.forget(PROBE_MEMORY)

    def _judge_probe(self, probe_ms: float, *, failed: bool) -> None:
        """A failed probe doubles the wait for the next (up to 16 intervals) and leaves its cost
        for `probe_paid_for`; one that paid resets both."""
        limit = 16 * self.config.probe_interval
        every = self.regime.probe_every
        self.regime.probe_every = min(2 * every, limit) if failed else self.config.probe_interval
        self.regime.probe_cost_ms = probe_ms if failed else None

    def _judge_remeasure(self, runner_up: TreeShape, *, lost: bool) -> None:
        """A runner-up that lost its re-measure waits twice as long for the next (up to 16
        intervals); one that won waits one interval."""
        interval = self.config.probe_interval
        every = self.regime.remeasure_every
        longer = min(2 * every.get(runner_up, interval), 16 * interval)
        every[runner_up] = longer if lost else interval

    def _remeasure(self, rates: dict[TreeShape, float]) -> None:
        """Runs the runner-up for one interval, of the tiers whose wait is over: a tier that
        lost its last re-measure waits longer, and must not hold back one that did not."""
        few = 1.0 / self.config.ema_alpha  # rounds a tier's own time is a plain mean of
        b, wait = self._batch, self.config.probe_interval
        due = remeasure_due(self.regime, rates, self._tier, self._stay, b, wait, few)
        unsettled = {t for t in due if 0 < self.cost.measured_rounds(t, b) < few}
        tier = runner_up(due, self._tier, self.config.explore_margin, unsettled)
        if tier is None:
            return
        start_remeasure(self.regime, tier, self._tier, self._batch)
        self._remeasured, self._tier = self._tier, tier
        self._remeasure_requests = 0

    def _remeasure_judged(self) -> bool:
        """Whether the runner-up has run long enough to be judged: `REMEASURE_REQUEST_ROUNDS`
        request-rounds with drafts at its tier (the round the target still ran at the tier
        left not counted), or `probe_interval` rounds when its rounds do not come."""
        if self._remeasure_requests >= REMEASURE_REQUEST_ROUNDS:
            return True
        return self._stay >= self.config.probe_interval

    def _young(self, rates: dict[TreeShape, float], best: TreeShape) -> TreeShape | None:
        """The best tier never tried at this batch size and regime, if it could come within
        `explore_margin` of the best: a chain whose time is unknown (nor profiled, but tier 0's
        profile does not count), or a tree whose acceptance is (`Regime.unlearnt`), judged by
        its ceiling. Margin 0.25: at {1: 700, 3: 800} (1 unmeasured) 1 is tried, at {1: 500,
        3: 800} not; a tree predicted at 600 as its depth's chain, at 900 by its ceiling: tried."""
        floor = rates[best] * (1.0 - self.config.explore_margin)
        bucket, regime = batch_bucket(self._batch), self.regime

        def could(t: TreeShape) -> float:
            return rates[t] * regime.ceiling_per_round(t) / regime.tokens_per_round(t)

        young = [
            t
            for t in rates
            if t != self._tier
            and could(t) >= floor
            and (self._untried(t) if t.steps else self.cost.measured_rounds(t, self._batch) == 0)
            and (self._sampled, bucket, t) not in self._explored
        ]
        if not young:
            return None
        tier = max(young, key=lambda t: rank(t, could(t)))
        self._explored.add((self._sampled, bucket, tier))  # once: its rounds may not teach
        return tier

    def _untried(self, t: TreeShape) -> bool:
        return not self.cost.measured(t, self._batch) or self.regime.unlearnt(t)

    def estimates(self) -> tuple[TierEstimate, ...]:
        regime = self.regime
        return tier_estimates(self.config.tiers, regime.cost, regime.tokens_per_round, self._batch)

    def describe(self) -> str:
        return description(self.regime, self.config, self._batch, self._sampled, self.probing)
