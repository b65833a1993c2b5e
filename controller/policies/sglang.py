"""The adaptive speculative policy: an EMA of accept length picks a tier, as SGLang does."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from controller.policies.goodput.acceptance import AcceptanceModel
from controller.policies.goodput.cost import CostModel, tier_estimates
from controller.policies.interface import (
    GatedPolicy,
    RoundSample,
    TierEstimate,
    as_tier,
    snap_to_candidate,
)
from specpair.runtime.shape import MAX_TREE_NODES, ShapeError, TreeShape, parse_tiers

# Sane ranges. A value past these is a typo or an attack, never a policy: 2^31 − 1 batches
# between decisions is 8 months at 100 rounds a second, and a hysteresis beyond the largest
# tier can never trigger (the EMA of accept lengths lies in [0, tier]).
MAX_STEPS = MAX_TREE_NODES  # a tier's chain fits the target's largest tree
MAX_BATCHES = 1_000_000
MAX_HYSTERESIS = float(MAX_STEPS)
MAX_BATCH_SIZE = 65_536
# `expect_tail`'s acceptance rate spans ~128 request-rounds, as the goodput kind's
# (`acceptance_window`): it is the pair's, slower to move than the EMA of accept lengths.
ACCEPTANCE_DECAY = 1.0 / 128


class PolicyKeys:
    """JSON-object plumbing shared by the policy kinds' frozen config dataclasses."""

    __slots__ = ()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        """Omitted keys take their defaults; unknown keys are an error naming them."""
        if not isinstance(values, Mapping):
            raise ValueError(f"policy config must be a JSON object, got {type(values).__name__}")
        names = cls.field_names()
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(
                f"unknown policy key(s) {', '.join(unknown)}; known: {', '.join(names)}"
            )
        # JSON lists arrive as lists; the frozen configs hold tuples.
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def replace_partial(self, **changes: Any) -> Self:
        """A validated copy with `changes` applied (a live UpdatePolicy)."""
        return self.from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}


@dataclass(frozen=True, slots=True)
class PolicyConfig(PolicyKeys):
    """SGLang's adaptive parameters; every key may be omitted in a JSON file or an update."""

    candidate_steps: tuple[int, ...] = (1, 3, 7)
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    # A round that accepted all s of its drafts counts s plus the drafts the largest tier would
    # be expected to accept past s (`AcceptanceModel.pooled_tail`), so that the EMA reads the
    # largest tier's accept length from any tier; false: s, SGLang's EMA, under which a tier
    # below the largest can hold the EMA under its own up-threshold (at 3 the EMA can never pass
    # 3, and a pair accepting 4.3 of 7 accepts ~2.3 of 3: under 2.5, so it stays at 3).
    expect_tail: bool = True
    # A move the thresholds call for is made only where the round times say it gains: the tier
    # it goes to must give more tokens per ms than the one it leaves (`_rates`, from the goodput
    # kind's acceptance and cost models). SGLang's thresholds read acceptance alone; at small
    # batches, where a verify's extra rows are nearly free, they left tier 7 for 3 at T 0.7
    # (accepting ~2.4 of 7) and lost ~9 % at batch 1 on an H200. False: SGLang's rule.
    cost_guard: bool = True

    def __post_init__(self) -> None:
        steps = self.candidate_steps
        normalized = check_steps(steps, minimum=0)
        # [0] alone is speculation off (a band of large batches: the target alone); beside
        # other tiers 0 could never be chosen back (no accept lengths come from a tier-0 round)
        if normalized != (0,) and (0 in normalized or len(normalized) < 2):
            raise ValueError(
                "candidate_steps needs at least two distinct tiers of at least 1, or [0] alone "
                f"(speculation off), got {list(steps)}"
            )
        object.__setattr__(self, "candidate_steps", normalized)
        check_gates(self)
        for name in ("down_hysteresis", "up_hysteresis"):
            value = finite_float(name, getattr(self, name))
            if abs(value) > MAX_HYSTERESIS:
                raise ValueError(
                    f"{name} must be in [-{MAX_HYSTERESIS:g}, {MAX_HYSTERESIS:g}], got {value:g}"
                )
            object.__setattr__(self, name, value)
        for name in ("expect_tail", "cost_guard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def tiers(self) -> tuple[TreeShape, ...]:
        return tuple(TreeShape(s) for s in self.candidate_steps)


FIELD_NAMES = PolicyConfig.field_names()
# The keys the wire's PolicyConfig and UpdatePolicyRequest name: SGLang's, and the tree shapes
# of the kinds that take them.
WIRE_FIELD_NAMES = (*FIELD_NAMES, "tree_shapes")


def check_steps(steps: object, *, minimum: int) -> tuple[int, ...]:
    """Sorted and deduplicated as SGLang does, so [7, 1, 3, 3] means tiers 1 < 3 < 7."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Sequence):
        raise ValueError(f"candidate_steps must be a list of ints, got {steps!r}")
    if not all(is_int(s) and minimum <= s <= MAX_STEPS for s in steps):
        raise ValueError(
            f"candidate_steps must be ints in [{minimum}, {MAX_STEPS}], got {list(steps)}"
        )
    return tuple(sorted(set(steps)))


def check_tree_shapes(shapes: object, steps: tuple[int, ...]) -> tuple[str, ...]:
    """`tree_shapes` as their canonical strings ("4X4X16" → "4x4x16"), in the order of the
    tiers; ValueError names the bad one, and any that repeats a tier."""
    if isinstance(shapes, str | bytes) or not isinstance(shapes, Sequence):
        raise ValueError(f'tree_shapes must be a list of shapes such as "4x4x16", got {shapes!r}')
    if not all(isinstance(s, str) for s in shapes):
        raise ValueError(f'tree_shapes must be strings such as "4x4x16", got {list(shapes)}')
    try:
        tiers = parse_tiers(steps, shapes)
    except ShapeError as exc:
        raise ValueError(str(exc)) from None
    return tuple(str(t) for t in tiers if not t.is_chain)


def check_gates(config: Any) -> None:
    """ema_alpha, update_interval and warmup_batches, which every built-in kind has."""
    alpha = finite_float("ema_alpha", config.ema_alpha)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"ema_alpha must be in (0, 1], got {config.ema_alpha}")
    object.__setattr__(config, "ema_alpha", alpha)
    check_int("update_interval", config.update_interval, 1, MAX_BATCHES)
    check_int("warmup_batches", config.warmup_batches, 0, MAX_BATCHES)


def check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def is_int(value: object) -> bool:
    # JSON `true` must not pass for 1.
    return isinstance(value, int) and not isinstance(value, bool)


def finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


__all__ = [
    "FIELD_NAMES",
    "WIRE_FIELD_NAMES",
    "AdaptiveSpeculativeParams",
    "PolicyConfig",
    "PolicyKeys",
    "check_gates",
    "check_int",
    "check_steps",
    "check_tree_shapes",
    "finite_float",
    "is_int",
    "snap_to_candidate",  # defined beside the gate both kinds share
]


class AdaptiveSpeculativeParams(GatedPolicy[PolicyConfig]):
    """EMA of accepted draft tokens per request → `speculative_num_steps`, one decision per
    `update_interval` batches after `warmup_batches`.

    Thresholds sit half a token below a tier: with [1, 3, 7] and the default hysteresis, at 3 the
    policy moves down to 1 when ema ≤ 1 − 0.5 − 0.25 = 0.25 and up to 7 when ema > 3 − 0.5 = 2.5.

    With `expect_tail` (the default) a request that accepted all s drafts below the largest
    tier S counts s + α + … + α^(S−s), α the pooled per-position acceptance learnt from the same
    rounds (`AcceptanceModel`, the goodput kind's: a chain that stops after a accepted drafts
    tried a + 1 positions, one that accepts all s tried s, none failed). At S itself, and for a
    request that stopped early (the largest tier, drafting the same chain, would have stopped
    there too), the count is SGLang's. Worked example: α 0.82 at tier 3 accepts 2.05 a round,
    0.55 of the rounds all three; counted 2.05 + 0.55 × 2.50 = 3.43, tier 7's own 3.43: over
    2.5, so up to 7.

    With `cost_guard` (the default) a move the thresholds call for is made only where the tier
    it goes to is predicted to give more tokens per ms (`_rates`).
    """

    def __init__(self, config: PolicyConfig, initial: int | TreeShape) -> None:
        super().__init__(config, initial)  # counts non-empty batches only
        # Neutral start: a tier of s drafts is "right" when about s − 1 of them are accepted.
        self._ema = float(self.current_steps - 1)
        self._acceptance = AcceptanceModel(ACCEPTANCE_DECAY)
        self._cost = CostModel(config.ema_alpha)  # `cost_guard`'s round times
        self._batch = 0  # the last drafted round's
        # the last move the guard refused: (from, to, tokens/ms at each), for `describe`
        self._refused: tuple[int, int, float, float] | None = None

    @property
    def draft_acceptance(self) -> float | None:
        """The pooled per-position acceptance `expect_tail` reads (None before a drafted round)."""
        return self._acceptance.alpha if self._acceptance.trials > 0 else None

    @property
    def ema(self) -> float:
        return self._ema

    def resume(self, ema: float, count: int) -> None:
        """Continues from a saved EMA and batch count (a restarted controller)."""
        self._ema, self._gate.count = float(ema), max(int(count), 0)

    def observe(self, sample: RoundSample) -> bool:
        """`update` with a round's accept lengths; rounds without drafts leave the EMA alone."""
        if not sample.speculative:
            return False
        if self.config.cost_guard:
            self._cost.observe(sample)
            self._batch = sample.batch_size
        steps = sample.request_steps or (sample.steps,) * len(sample.accept_lengths)
        return self.update(sample.accept_lengths, steps)

    def estimates(self) -> tuple[TierEstimate, ...]:
        """With `cost_guard`, what it predicts of each candidate at the last round's batch
        (`ctl status`'s table); () without it, or before a drafted round."""
        if not self.config.cost_guard or not self._batch:
            return ()
        return tier_estimates(self.config.tiers, self._cost, self._tokens, self._batch)

    def describe(self) -> str:
        steps = self.current_steps
        c, i = self.config.candidate_steps, self.config.candidate_steps.index(steps)
        down = c[i - 1] - 0.5 + self.config.down_hysteresis if i > 0 else None
        up = c[i] - 0.5 + self.config.up_hysteresis if i < len(c) - 1 else None
        alpha = self.draft_acceptance
        tail = (
            f" (a full chain counts its expected tail, draft acceptance {alpha:.2f})"
            if self.config.expect_tail and alpha is not None
            else ""
        )
        return (
            f"sglang: EMA accept length {self._ema:.2f}{tail} over {self.count} batches; "
            f"at {steps}: down when EMA <= {down}, up when EMA > {up}"
            + (", where the round times say the move gains" if self.config.cost_guard else "")
            + self._refused_line()
        )

    def _refused_line(self) -> str:
        if self._refused is None:
            return ""
        frm, to, now, then = self._refused
        return f"; last refused {frm} → {to}: {then:.3f} against {now:.3f} tokens/ms predicted"

    def update(self, accept_lengths: Sequence[int], steps: Sequence[int] = ()) -> bool:
        """Feeds one batch (per request, accepted drafts without the bonus, and the tier each
        ran at, default the current one); True if the tier changed."""
        if not accept_lengths:
            return False
        if any(a < 0 for a in accept_lengths):
            raise ValueError(f"accept_lengths must be >= 0, got {list(accept_lengths)}")
        steps = steps or (self.current_steps,) * len(accept_lengths)
        if len(steps) != len(accept_lengths):
            raise ValueError(f"{len(accept_lengths)} accept lengths, {len(steps)} tiers")
        if self.config.expect_tail or self.config.cost_guard:
            self._acceptance.observe(max(steps), accept_lengths, steps)
        counted = (
            self._with_tails(accept_lengths, steps) if self.config.expect_tail else accept_lengths
        )
        cfg = self.config
        mean = sum(counted) / len(counted)
        self._ema = (1.0 - cfg.ema_alpha) * self._ema + cfg.ema_alpha * mean
        return self._gate.tick() and self._decide()

    def _with_tails(self, accept_lengths: Sequence[int], steps: Sequence[int]) -> tuple[float, ...]:
        # The pooled rate, not each position's own, as measured (bench/RESULTS.md, "The default
        # policy"): rates learnt at 7 for positions 4-7, lower than 1-3's, read the tail lower
        # and at T 0.7 held the rule at 3 more (a CPU simulation with rates falling 0.80 → 0.60
        # by position: 0.69 of the rounds at 7 at batch 64 against 0.98), where tier 7 was the
        # faster static tier on the GPU.
        top = max(self.config.candidate_steps)
        return tuple(
            s + self._acceptance.pooled_tail(top - s) if 0 < s <= a and s < top else float(a)
            for a, s in zip(accept_lengths, steps, strict=True)
        )

    def _decide(self) -> bool:
        c, old = self.config.candidate_steps, self.current_steps
        i = c.index(old)
        # Several tiers may be crossed in one decision (7 → 1 when the EMA collapsed).
        while i > 0 and self._ema <= c[i - 1] - 0.5 + self.config.down_hysteresis:
            i -= 1
        while i < len(c) - 1 and self._ema > c[i] - 0.5 + self.config.up_hysteresis:
            i += 1
        if c[i] != old and self.config.cost_guard:
            rates = self._rates(old, c[i])
            if rates is not None and rates[1] <= rates[0]:
                self._refused = (old, c[i], *rates)
                return False
        self._tier = TreeShape(c[i])
        return c[i] != old

    def _rates(self, old: int, new: int) -> tuple[float, float] | None:
        """Tokens per ms a request gains at tier `old` and at `new` at the last round's batch:
        tokens a round (1 + α + … + α^s, α the pooled acceptance) over the round's time
        (`CostModel.round_ms`: an unmeasured tier predicted from a measured one by the draft's
        time per step, the verify flat until two tiers are measured). None where either time
        is unknown: the thresholds decide. Worked example, batch 1 at T 0.7 on an H200:
        tier 7's round 10.4 ms, 3.0 of it the draft's 7 steps → tier 3's 10.4 − 4 · 0.43 = 8.7
        ms (8.4 measured); acceptance 0.74 a position: 3.5 tokens at 7, 2.7 at 3; 0.34 against
        0.31 tokens a ms: no move down."""
        b, tokens = self._batch, self._tokens
        if not b:
            return None
        now, then = self._cost.round_ms(old, b, tokens), self._cost.round_ms(new, b, tokens)
        if now is None or then is None:
            return None
        return tokens(old) / now, tokens(new) / then

    def _tokens(self, tier: int | TreeShape) -> float:
        """Tokens a request gains per round at a chain tier, at the pooled rate as
        `expect_tail`'s: positions 4-7's own rates, learnt in a few rounds at 7 and then left
        standing at 3, read the long chain low and held a good pair at 3 (a CPU simulation at
        a uniform 0.74: 0.50 learnt at positions 5 and 6)."""
        return 1.0 + self._acceptance.pooled_tail(as_tier(tier).steps)

    def reconfigure(self, config: PolicyConfig) -> bool:
        """Swaps in `config`, keeping the EMA and batch count; the tier snaps to the new
        candidates. True if the tier changed. The guard's round times decay at the new
        `ema_alpha` from here on, as the EMA does."""
        self._cost.alpha = config.ema_alpha
        return self._swap_config(config)
