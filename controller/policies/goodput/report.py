"""What the goodput policy reports of itself: each tier's predicted tokens/s (`ctl status`'s
estimates) and a line on what its models learnt. The policy itself is `policy.py`'s."""

from __future__ import annotations

from controller.policies.goodput.config import GoodputConfig, Regime
from specpair.runtime.shape import tier_name
from specpair.tier_estimate import TierEstimate


def tier_estimates(
    regime: Regime, config: GoodputConfig, batch_size: int
) -> tuple[TierEstimate, ...]:
    """tokens/s = batch · E[tokens/round] / round time for each candidate tier whose round time
    the cost model can predict at `batch_size`; the others are left out."""
    out = []
    for t in config.tiers:
        round_ms = regime.cost.round_ms(t, batch_size, regime.tokens_per_round)
        if round_ms is None:
            continue
        e = regime.tokens_per_round(t)
        out.append(
            TierEstimate(
                steps=t.steps,
                tokens_per_s=1e3 * batch_size * e / round_ms,
                round_ms=round_ms,
                tokens_per_round=e,
                observed_rounds=regime.cost.measured_rounds(t, batch_size),
                shape=tier_name(t),
            )
        )
    return tuple(out)


def description(
    regime: Regime, config: GoodputConfig, batch_size: int, sampled: bool, probing: bool
) -> str:
    """The current regime's acceptance, per position and per tree tier, and the rule."""
    a = regime.acceptance
    longest = max(config.candidate_steps, default=0)
    rates = ", ".join(f"{p:.2f}" for p in a.position_rates(longest))
    state = " (probing)" if probing else ""
    kind = "sampled" if sampled else "greedy"
    trees = "".join(
        f"; tree {t}: E {regime.tokens_per_round(t):.2f} ({m.trials:.0f} trials)"
        for t, m in sorted(regime.trees.items())
        if t in config.tiers
    )
    return (
        f"goodput at batch {batch_size}, {kind} batches{state}: acceptance α "
        f"{a.alpha:.3f} ({a.trials:.0f} decayed trials), per position [{rates}]{trees}; "
        f"tokens/s = batch · E[tokens/round] / round time; switch on > "
        f"{config.min_gain:.0%} gain"
    )
