"""What the goodput policy reports of itself: a line on what its models learnt (each tier's
predicted tokens/s is `cost.tier_estimates`). The policy itself is `policy.py`'s."""

from __future__ import annotations

from controller.policies.goodput.config import GoodputConfig, Regime


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
