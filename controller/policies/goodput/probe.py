"""When the goodput policy probes from tier 0, and which tier: what a probe costs and whether
it could pay.

At tier 0 nothing is learnt about drafts, so every `probe_interval` rounds the policy tries the
smallest positive tier that could pay for at least `probe_rounds` rounds with drafts
(`could_pay`), then decides again from tier 0's standpoint and from what the probe measured
(the acceptance learnt before it is scaled down to `PROBE_MEMORY` trials: it spans
`acceptance_window` request-rounds, and what made the policy leave would outvote a short
probe); each probe that returns to tier 0 doubles the interval (up to 16×), one that stays
resets it: a probe that never pays would otherwise cost the same share of the time forever.
Probes are also paced by what they cost (`probe_paid_for`): the next waits until the time
spent at tier 0 since the last one, times `probe_budget`, covers what the last failed probe
cost beyond tier 0 (its rounds, the draft's catch-up included), or before any has failed what
the cost model predicts for `probe_rounds` rounds. E.g. budget 2 %, a probe that cost 350 ms:
the next after 17.5 s at tier 0, whatever the round count says.

At a positive tier the policy re-measures the runner-up (`runner_up`): a tier learns only
from its own rounds, so one measured in a handful of early rounds (the first requests'
openings, which drafts predict worst; a host still busy) keeps that estimate for good once
another looks better (tier 0 too, while its time rests on a profile or a few rounds).
After `remeasure_every` rounds at a tier, the best other tier predicted
within `explore_margin` of it, or whose own time is still the mean of its first few rounds
(fewer than 1 / ema_alpha), runs with its own time and acceptance dropped first (`start_remeasure`)
so that its rounds decide; it must then beat the tier it left by `min_gain` to stay. Each loss
doubles that tier's wait (up to 16×), a win resets it. It runs at least one interval and
`REMEASURE_REQUEST_ROUNDS` request-rounds of its own (the target's first round after the switch
still runs at the tier left): code acceptance comes in bursts that hit every tier alike, and the
tier left is judged by its long-run acceptance, so a few rounds meeting a burst would decide
against the runner-up (bench/CHOICES.md).
"""

from __future__ import annotations

from collections.abc import Collection

from controller.policies.goodput.config import GoodputConfig, Regime
from controller.policies.goodput.cost import CostModel
from controller.policies.interface import as_tier
from specpair.runtime.shape import TreeShape

# Per-position acceptance a probe must be able to pay at, above what a trained EAGLE head
# reaches on code, greedy; a tier that loses even at this is not tried.
OPTIMISTIC_ACCEPTANCE = 0.9
PROBE_MEMORY = 2.0  # trials of what was learnt before a probe that its rounds start from
# Request-rounds a re-measure lasts at least. Chain 3's accepted drafts a round on the bench's
# code (2.03 over the run, batch 1): 1.0–3.0 in 90 % of 4-round spans, 1.25–2.75 over 16.
REMEASURE_REQUEST_ROUNDS = 16


def probe_cost(cost: CostModel, batch_size: int, rounds: int, ms: float) -> float:
    """What `rounds` probe rounds taking `ms` cost beyond as many rounds at tier 0."""
    zero = cost.round_ms(0, batch_size)
    return max(ms - rounds * (zero or 0.0), 0.0)


def probe_paid_for(
    regime: Regime, config: GoodputConfig, tier: TreeShape, batch_size: int, zero_ms: float
) -> bool:
    """Whether `zero_ms` at tier 0 since the last probe, times `probe_budget`, covers what a
    probe of `tier` costs: the last failed probe's, else the cost model's prediction (none
    predicted: the round count alone decides). E.g. a probe that cost 350 ms, budget 2 %:
    due after 17.5 s at tier 0."""
    cost = regime.probe_cost_ms
    if cost is None:
        rounds_ms = regime.cost.round_ms(tier, batch_size, regime.tokens_per_round)
        if rounds_ms is None or regime.cost.round_ms(0, batch_size) is None:
            return True
        n = config.probe_rounds
        cost = probe_cost(regime.cost, batch_size, n, n * rounds_ms)
    return zero_ms * config.probe_budget >= cost


def could_pay(cost: CostModel, tier: TreeShape, batch_size: int, min_gain: float) -> bool:
    """Whether `tier` would beat tier 0 by `min_gain` at an optimistic acceptance
    (`OPTIMISTIC_ACCEPTANCE` at every position); a probe of a tier that could not is time
    lost. E.g. tier 7 at 95 ms a round gives at most 5.7 / 95 ms = 60 tokens/s against tier
    0's 1 / 12.9 ms = 78 (with every draft accepted it would be 84): never probed."""
    if not cost.trusted(tier, batch_size):
        return True  # too few rounds of its own to rule it out

    def optimistic(t: int | TreeShape) -> float:
        # a tree accepts at most its depth: its ceiling is its depth's chain's
        return sum(OPTIMISTIC_ACCEPTANCE**k for k in range(as_tier(t).steps + 1))

    ceiling = cost.round_ms(tier, batch_size, optimistic)
    zero = cost.round_ms(0, batch_size, optimistic)
    if ceiling is None or zero is None:
        return True
    return optimistic(tier) / ceiling > (1.0 + min_gain) / zero


def remeasure_due(
    regime: Regime,
    rates: dict[TreeShape, float],
    current: TreeShape,
    stay: int,
    batch_size: int,
    wait: int,
    few: float,
) -> dict[TreeShape, float]:
    """`rates` of `current` and of the tiers whose wait is over after `stay` rounds at it: a
    tier that lost its last re-measure waits longer, and must not hold back one that did not.
    Tier 0 learns only its time: it is due while that rests on a profile or on fewer than
    `few` rounds (a settled one stays settled: no acceptance of its own changes)."""

    def due(t: TreeShape) -> bool:
        if t == current:
            return True
        if stay < regime.remeasure_every.get(t, wait):
            return False
        return t.steps > 0 or regime.cost.measured_rounds(t, batch_size) < few

    return {t: r for t, r in rates.items() if due(t)}


def runner_up(
    rates: dict[TreeShape, float],
    current: TreeShape,
    margin: float,
    unsettled: Collection[TreeShape] = (),
) -> TreeShape | None:
    """The best-predicted tier but `current` that is within `margin` of it, or whose own time
    is `unsettled` (a mean of its first few rounds: they may all be atypical). At margin 0.25
    and {1: 72, 3: 68, 3x2x6: 89}, from 3x2x6 it is tier 1 (≥ 66.75); at {1: 42, 3: 47} none,
    unless tier 3's time is unsettled. Tier 0 is one too: its time may rest on a start-up
    profile whose rounds met other requests (batch 64 profiled at 17.3 ms, served at 10.4)."""
    floor = rates[current] * (1.0 - margin)
    near = [t for t, r in rates.items() if t != current and (r >= floor or t in unsettled)]
    return max(near, key=lambda t: rank(t, rates[t]), default=None)


def start_remeasure(regime: Regime, tier: TreeShape, incumbent: TreeShape, batch_size: int) -> None:
    """Drops what `tier` learnt in rounds of its own: its time in this batch bucket and,
    unless the incumbent's rounds teach the same model (two chains) or it is tier 0, its
    acceptance down to `PROBE_MEMORY` trials."""
    regime.cost.forget(tier, batch_size)
    model = regime.model(tier)
    if tier.steps > 0 and model is not regime.model(incumbent):  # tier 0 learns no acceptance
        model.forget(PROBE_MEMORY)


def rank(tier: TreeShape, rate: float) -> tuple[float, int, int]:
    """Orders tiers by predicted tokens/s, a tie going to the cheaper tier (fewer tokens
    verified, then fewer steps)."""
    return rate, -tier.verified, -tier.steps
