"""The goodput policy: the tier with the most expected tokens per second, tier 0 included.

For each candidate tier s at the current batch size b the policy predicts

    tokens/s(s) = b · E[tokens per round](s) / T(s, b)

from an acceptance model (E, per-position acceptance learnt from accept lengths) and a cost
model (T, round time per tier and batch size, profiled at start-up and learnt from the rounds'
timings): see goodput_model.py. E.g. α = 0.6 → E = 1.6, 2.18, 2.46 at tiers 1, 3, 7; with
T = 22, 30, 38 ms and T(0) = 20 ms at batch 1 that is 72.7, 72.5, 64.7 and 50 tokens/s: tier 1
(but by 0.3 %, inside the default margin: from tier 3 the policy would stay).

Guards, shared with the sglang kind: no decision in the first `warmup_batches` rounds, then one
every `update_interval` rounds; a move needs a predicted gain over the current tier of more than
`min_gain` (5 %: bursty acceptance must not flip a near tie between two tiers). At tier 0
nothing is learnt about drafts, so every `probe_interval` rounds the policy tries the smallest
positive tier that could pay for at least `probe_rounds` rounds with drafts, then decides again
from tier 0's standpoint and from what the probe measured (the acceptance learnt before it is
scaled down to two trials: it spans `acceptance_window` request-rounds, and what made the
policy leave would outvote a short probe); each probe that returns to tier 0 doubles the
interval (up to 16×), one that stays resets it: a probe that never pays would otherwise cost
the same share of the time forever. Probes are also paced by what they cost: the next waits
until the time spent at tier 0 since the last one, times `probe_budget`, covers what the last
failed probe cost beyond tier 0 (its rounds, the draft's catch-up included), or before any has
failed what the cost model predicts for `probe_rounds` rounds. E.g. budget 2 %, a probe that
cost 350 ms: the next after 17.5 s at tier 0, whatever the round count says.

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
it — e.g. verify held flat when only one tier was measured — cannot hide a better tier.
"""

from __future__ import annotations

from controller.goodput_config import GoodputConfig, Regime
from controller.goodput_model import AcceptanceModel, CostModel, batch_bucket
from controller.interface import GatedPolicy, RoundSample, TierEstimate, snap_to_candidate
from specpair.runtime.shape import TreeShape
from specpair.tiers import RegimeSteps

# Per-position acceptance a probe must be able to pay at, above what a trained EAGLE head
# reaches on code, greedy; a tier that loses even at this is not tried.
OPTIMISTIC_ACCEPTANCE = 0.9
PROBE_MEMORY = 2.0  # trials of what was learnt before a probe that its rounds start from


class GoodputPolicy(GatedPolicy[GoodputConfig]):
    """Chooses the tier with the highest predicted tokens/s; see the module docstring."""

    def __init__(self, config: GoodputConfig, initial_steps: int) -> None:
        super().__init__(config, initial_steps)  # counts every round, tier 0's included
        self._start = self._steps
        self._regimes = {
            False: Regime.fresh(config, config.profile_ms),
            True: Regime.fresh(config, config.sampled_profile_ms),
        }
        self._sampled = False  # the regime of the last round
        self._batch = 1
        self._rounds_at_zero = 0
        self._zero_ms = 0.0  # the time of those rounds
        self._last_steps = self._steps  # the tier the last round ran at
        self._probe_rounds: int | None = None  # rounds with drafts so far while probing
        self._probe_ms = 0.0  # their time
        self._explored: set[tuple[bool, int, int]] = set()  # (sampled, batch bucket, tier)

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
        return self.acceptance.tokens_per_round(self._steps) - 1.0

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
            if regime.steps is not None:  # where it resumes must stay a tier the target has
                regime.steps = snap_to_candidate(regime.steps, config.candidate_steps)
        return self._swap_config(config)

    def observe(self, sample: RoundSample) -> bool:
        old = self._steps
        changed_regime = (sample.sampled > 0) != self._sampled
        if changed_regime:
            # Where the target ran this round (`regime_steps`), from what was known before it.
            self._regimes[self._sampled].steps = old
            self._sampled = not self._sampled
            self._steps = self._regime_start(self._sampled)
            self._probe_rounds, self._rounds_at_zero, self._zero_ms = None, 0, 0.0
        regime = self.regime
        if not (sample.steps > 0 and self._last_steps == 0):
            # The first round with drafts after rounds without: the draft extends every token
            # it missed first, several times a round's cost; learnt as the tier's, it would keep
            # the policy at tier 0 for good. What it costs is the catch-up's, not the tier's.
            regime.cost.observe(sample)
        self._last_steps = sample.steps
        regime.acceptance.observe(sample.steps, sample.accept_lengths, sample.request_steps)
        regime.rounds += 1
        self._batch = sample.batch_size
        if self._probe_rounds is not None and sample.speculative:
            self._probe_rounds += 1
            self._probe_ms += sample.total_ms
        elif self._steps == 0:
            self._rounds_at_zero += 1
            self._zero_ms += sample.total_ms
        due = self._gate.tick()
        if changed_regime:
            # Decided at once from what this regime taught before (a regime never seen, or seen
            # only at tier 0 and now at a positive tier, learns first).
            learnt = regime.rounds > self.config.warmup_batches + 1
            if learnt and (self._steps == 0 or regime.acceptance.trials > 0):
                self._decide()
            return self._steps != old
        return due and self._decide()

    @property
    def regime_steps(self) -> RegimeSteps:
        """The tier for each regime: the current one's, and where the other left off (or where
        it would start). The target runs a batch that changes regime at its regime's tier from
        the first round; the decision below follows a round or more later."""
        other = self._regime_start(not self._sampled)
        greedy, sampled = (other, self._steps) if self._sampled else (self._steps, other)
        return RegimeSteps(greedy=TreeShape(greedy), sampled=TreeShape(sampled))

    def _regime_start(self, sampled: bool) -> int:
        """Where regime `sampled` starts: where it left off; never seen, the best its profile
        predicts (with the prior acceptance), else the starting tier."""
        regime = self._regimes[sampled]
        if regime.steps is not None:
            return regime.steps
        b = self._batch
        rates = {s: r for s in self.config.candidate_steps if (r := regime.tokens_per_s(s, b))}
        if rates:
            return max(rates, key=lambda s: (rates[s], -s))
        positive = [s for s in self.config.candidate_steps if s > 0]
        return self._start if self._start > 0 else (positive or [0])[0]

    def tokens_per_s(self, steps: int, batch_size: int | None = None) -> float | None:
        return self.regime.tokens_per_s(steps, batch_size or self._batch)

    def _decide(self) -> bool:
        old, baseline = self._steps, self._steps
        probed = self._probe_rounds is not None
        probe_cost = 0.0
        if self._probe_rounds is not None:
            if self._probe_rounds < self.config.probe_rounds:
                return False
            probe_cost = self._probe_cost(self._probe_rounds, self._probe_ms)
            self._probe_rounds, baseline = None, 0  # the probe must earn its way off tier 0
        elif self._steps == 0 and self._rounds_at_zero >= self.regime.probe_every:
            positive = [s for s in self.config.candidate_steps if s > 0 and self._could_pay(s)]
            if positive and self._probe_paid_for(positive[0]):
                self._rounds_at_zero, self._zero_ms = 0, 0.0
                self._steps, self._probe_rounds, self._probe_ms = positive[0], 0, 0.0
                # The probe's own rounds decide: the long acceptance window would otherwise
                # let what made the policy leave (say 30 rejections) outvote them for good.
                self.acceptance.forget(PROBE_MEMORY)
                return True
        rates = {s: r for s in self.config.candidate_steps if (r := self.tokens_per_s(s))}
        if not rates:
            return False
        best = max(rates, key=lambda s: (rates[s], -s))  # a tie goes to the cheaper tier
        base_rate = rates.get(baseline)
        if base_rate is None and baseline > 0 and not probed:
            return False  # no estimate of the current tier yet: learn it before comparing
        if (young := self._young(rates, best)) is not None:
            self._steps = young
        elif base_rate is None or rates[best] > base_rate * (1.0 + self.config.min_gain):
            self._steps = best
        else:
            self._steps = baseline
        if self._steps == 0 and old != 0:
            self._rounds_at_zero, self._zero_ms = 0, 0.0
        if probed:
            limit = 16 * self.config.probe_interval
            failed = self._steps == 0
            self.regime.probe_every = (
                min(2 * self.regime.probe_every, limit) if failed else self.config.probe_interval
            )
            self.regime.probe_cost_ms = probe_cost if failed else None
        return self._steps != old

    def _probe_cost(self, rounds: int, ms: float) -> float:
        """What `rounds` probe rounds taking `ms` cost beyond as many rounds at tier 0."""
        zero = self.cost.round_ms(0, self._batch)
        return max(ms - rounds * (zero or 0.0), 0.0)

    def _probe_paid_for(self, steps: int) -> bool:
        """Whether the time at tier 0 since the last probe, times `probe_budget`, covers what a
        probe of `steps` costs: the last failed probe's, else the cost model's prediction (none
        predicted: the round count alone decides). E.g. a probe that cost 350 ms, budget 2 %:
        due after 17.5 s at tier 0."""
        cost = self.regime.probe_cost_ms
        if cost is None:
            rounds_ms = self.cost.round_ms(steps, self._batch, self.acceptance.tokens_per_round)
            if rounds_ms is None or self.cost.round_ms(0, self._batch) is None:
                return True
            n = self.config.probe_rounds
            cost = self._probe_cost(n, n * rounds_ms)
        return self._zero_ms * self.config.probe_budget >= cost

    def _could_pay(self, steps: int) -> bool:
        """Whether tier `steps` would beat tier 0 by `min_gain` at an optimistic acceptance
        (`OPTIMISTIC_ACCEPTANCE` at every position); a probe of a tier that could not is time
        lost. E.g. tier 7 at 95 ms a round gives at most 5.7 / 95 ms = 60 tokens/s against tier
        0's 1 / 12.9 ms = 78 (with every draft accepted it would be 84): never probed."""
        b = self._batch
        if not self.cost.trusted(steps, b):
            return True  # too few rounds of its own to rule it out

        def optimistic(s: int) -> float:
            return sum(OPTIMISTIC_ACCEPTANCE**k for k in range(s + 1))

        ceiling = self.cost.round_ms(steps, b, optimistic)
        zero = self.cost.round_ms(0, b, optimistic)
        if ceiling is None or zero is None:
            return True
        return optimistic(steps) / ceiling > (1.0 + self.config.min_gain) / zero

    def _young(self, rates: dict[int, float], best: int) -> int | None:
        """The best-predicted tier never measured (nor profiled) at this batch size and regime,
        if it comes within `explore_margin` of the best: with margin 0.25 and predictions
        {1: 700, 3: 800} (tier 1 unmeasured), tier 1 is tried; at {1: 500, 3: 800} it is not."""
        floor = rates[best] * (1.0 - self.config.explore_margin)
        bucket = batch_bucket(self._batch)
        young = [
            s
            for s, r in rates.items()
            if s != self._steps
            and r >= floor
            and not self.cost.measured(s, self._batch)
            and (self._sampled, bucket, s) not in self._explored
        ]
        if not young:
            return None
        steps = max(young, key=lambda s: rates[s])
        self._explored.add((self._sampled, bucket, steps))  # once: its rounds may not teach
        return steps

    def estimates(self) -> tuple[TierEstimate, ...]:
        out = []
        for s in self.config.candidate_steps:
            round_ms = self.cost.round_ms(s, self._batch, self.acceptance.tokens_per_round)
            if round_ms is None:
                continue
            e = self.acceptance.tokens_per_round(s)
            out.append(
                TierEstimate(
                    steps=s,
                    tokens_per_s=1e3 * self._batch * e / round_ms,
                    round_ms=round_ms,
                    tokens_per_round=e,
                    observed_rounds=self.cost.measured_rounds(s, self._batch),
                )
            )
        return tuple(out)

    def describe(self) -> str:
        a = self.acceptance
        rates = ", ".join(f"{p:.2f}" for p in a.position_rates(max(self.candidate_steps)))
        state = " (probing)" if self.probing else ""
        regime = "sampled" if self._sampled else "greedy"
        return (
            f"goodput at batch {self._batch}, {regime} batches{state}: acceptance α "
            f"{a.alpha:.3f} ({a.trials:.0f} decayed trials), per position [{rates}]; tokens/s = "
            f"batch · E[tokens/round] / round time; switch on > {self.config.min_gain:.0%} gain"
        )
