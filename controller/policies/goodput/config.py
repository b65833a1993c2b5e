"""The goodput policy's keys (`GoodputConfig`, with the start-up cost profiles) and what it
keeps per sampling regime (`Regime`); the policy itself is `policy.py`'s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.policies.goodput.acceptance import AcceptanceModel
from controller.policies.goodput.cost import CostModel
from controller.policies.interface import RoundSample, as_tier
from controller.policies.sglang import (
    MAX_BATCH_SIZE,
    MAX_BATCHES,
    MAX_STEPS,
    PolicyKeys,
    check_gates,
    check_int,
    check_steps,
    check_tree_shapes,
    finite_float,
)
from specpair.runtime.shape import TreeShape

MAX_GAIN = 10.0  # a predicted gain of 1000 % is never required to move
MAX_ROUND_MS = 1e6

ProfileMs = tuple[tuple[int, TreeShape, float], ...]  # (batch size, tier, round ms)


@dataclass(frozen=True, slots=True)
class GoodputConfig(PolicyKeys):
    """`profile_ms` seeds the greedy regime's cost model, in vLLM's batch_stats shape: {"1":
    {"0": 20.1, "3": 30.4}, "16": {...}} (batch size → tier → round ms); tiers it omits are
    predicted. `sampled_profile_ms` seeds the sampled regime's, likewise. `tree_shapes` are
    tree tiers ("4x4x16") beside candidate_steps' chains; the profiles name them by shape:
    {"1": {"7": 11.8, "5x4x20": 12.3}}."""

    candidate_steps: tuple[int, ...] = (1, 3, 7)
    ema_alpha: float = 0.1
    # Request-rounds the acceptance estimate spans. Code acceptance comes in bursts: a short
    # span chases them, and the policy swings between tiers with it.
    acceptance_window: int = 128
    update_interval: int = 5
    warmup_batches: int = 5
    min_gain: float = 0.05
    explore_margin: float = 0.25
    probe_interval: int = 64
    probe_rounds: int = 8
    # The share of tier-0 time that probes may cost: where a probe costs much more than the
    # rounds between probes (the draft's catch-up, slow rounds at a high tier), pacing by
    # rounds alone lets probes take a large share of the time.
    probe_budget: float = 0.02
    profile_ms: ProfileMs = ()
    sampled_profile_ms: ProfileMs = ()
    tree_shapes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        steps = check_steps(self.candidate_steps, minimum=0)
        shapes = check_tree_shapes(self.tree_shapes, steps)
        if not steps and not shapes:
            raise ValueError("candidate_steps (with tree_shapes) needs at least one tier")
        object.__setattr__(self, "candidate_steps", steps)
        object.__setattr__(self, "tree_shapes", shapes)
        check_gates(self)
        gain = finite_float("min_gain", self.min_gain)
        if not 0.0 <= gain <= MAX_GAIN:
            raise ValueError(f"min_gain must be in [0, {MAX_GAIN:g}], got {self.min_gain}")
        margin = finite_float("explore_margin", self.explore_margin)
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"explore_margin must be in [0, 1), got {self.explore_margin}")
        budget = finite_float("probe_budget", self.probe_budget)
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"probe_budget must be in (0, 1], got {self.probe_budget}")
        object.__setattr__(self, "min_gain", gain)
        object.__setattr__(self, "explore_margin", margin)
        object.__setattr__(self, "probe_budget", budget)
        for name in ("probe_interval", "probe_rounds", "acceptance_window"):
            check_int(name, getattr(self, name), 1, MAX_BATCHES)
        for name in ("profile_ms", "sampled_profile_ms"):
            object.__setattr__(self, name, parse_profile(getattr(self, name), name))

    @property
    def tiers(self) -> tuple[TreeShape, ...]:
        """Every candidate, sorted: [0, 1, 3] and ["4x4x16"] → 0, 1, 3, 4x4x16."""
        return tuple(
            sorted([*map(TreeShape, self.candidate_steps), *map(TreeShape.parse, self.tree_shapes)])
        )

    @property
    def acceptance_decay(self) -> float:
        """The acceptance model's decay per accept length, for its `acceptance_window`."""
        return 1.0 / self.acceptance_window

    def to_dict(self) -> dict[str, Any]:
        out = PolicyKeys.to_dict(self)
        for name in ("profile_ms", "sampled_profile_ms"):
            profile: dict[str, dict[str, float]] = {}
            for batch, tier, ms in getattr(self, name):
                profile.setdefault(str(batch), {})[str(tier)] = ms
            out[name] = profile
        return out


def parse_profile(raw: object, name: str = "profile_ms") -> ProfileMs:
    """{batch: {tier: ms}} (JSON keys are strings; a tier is a chain's steps or a tree's shape,
    "7" or "4x4x16") or (batch, tier, ms) triples → triples."""
    if isinstance(raw, Mapping):
        if not all(isinstance(v, Mapping) for v in raw.values()):
            raise ValueError(f"{name} must map batch size → {{tier: ms}}, got {raw!r}")
        raw = [(b, s, ms) for b, tiers in raw.items() for s, ms in tiers.items()]
    if not isinstance(raw, list | tuple):
        raise ValueError(f"{name} must be an object, got {raw!r}")
    out = []
    for item in raw:
        try:
            batch, tier, ms = int(item[0]), _profile_tier(item[1]), float(item[2])
        except (TypeError, ValueError, IndexError, KeyError):
            raise ValueError(f"{name} entry {item!r} is not (batch, tier, ms)") from None
        if not (
            1 <= batch <= MAX_BATCH_SIZE and tier.steps <= MAX_STEPS and 0.0 < ms <= MAX_ROUND_MS
        ):
            raise ValueError(
                f"{name}: batch {batch} tier {tier} ms {ms:g} needs batch in [1, "
                f"{MAX_BATCH_SIZE}], tier steps in [0, {MAX_STEPS}], ms in (0, {MAX_ROUND_MS:g}]"
            )
        out.append((batch, tier, ms))
    return tuple(sorted(out))


def _profile_tier(raw: object) -> TreeShape:
    """A profile's tier: an int or a numeric string is a chain, "4x4x16" a tree (a bool or a
    float is neither); ShapeError, a ValueError, on anything else."""
    if isinstance(raw, TreeShape):
        return raw
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise ValueError(f"not a tier: {raw!r}")
    return TreeShape.parse(raw)


@dataclass
class Regime:
    """What the policy learnt of one sampling regime (greedy, or some request sampling)."""

    acceptance: AcceptanceModel  # the chains'
    cost: CostModel
    probe_every: int  # rounds at tier 0 between probes, doubled by each probe that failed
    # What the last probe that failed cost beyond tier 0's rounds, the draft's catch-up
    # included (None before one has: the cost model predicts it)
    probe_cost_ms: float | None = None
    rounds: int = 0
    tier: TreeShape | None = None  # the tier it ran at when the batch last left it
    # Per tier, rounds the policy stays at another before re-measuring it (the probe interval
    # until it lost a re-measure; each loss doubles it: probe.py)
    remeasure_every: dict[TreeShape, int] = field(default_factory=dict)
    # Per tree shape, its own acceptance by depth: a tree's branches are no chain's positions.
    # Before its rounds teach it, a tree is predicted as the chain of its depth (the chains'
    # pooled rate at every depth): its extra branches are credited nothing until measured.
    trees: dict[TreeShape, AcceptanceModel] = field(default_factory=dict)

    @classmethod
    def fresh(cls, config: GoodputConfig, profile: ProfileMs = ()) -> Regime:
        return cls(
            AcceptanceModel(config.acceptance_decay),
            CostModel(config.ema_alpha, profile),
            config.probe_interval,
        )

    def model(self, tier: TreeShape) -> AcceptanceModel:
        """The acceptance model `tier`'s rounds teach: the chains' or its tree's own."""
        return self.acceptance if tier.is_chain else self.tree(tier)

    def tree(self, shape: TreeShape) -> AcceptanceModel:
        model = self.trees.get(shape)
        if model is None:
            model = self.trees[shape] = AcceptanceModel(self.acceptance.decay)
        model.prior_alpha = self.acceptance.alpha
        return model

    def observe(self, sample: RoundSample) -> None:
        """The round's accept lengths, to the chains' model or to its tree's."""
        tier = sample.tier
        self.model(tier).observe(tier.steps, sample.accept_lengths, sample.request_steps)

    def tokens_per_round(self, tier: int | TreeShape) -> float:
        """Expected tokens a request gains per round at `tier` (E of a chain or of a tree)."""
        tier = as_tier(tier)
        if tier.is_chain:
            return self.acceptance.tokens_per_round(tier.steps)
        return self.tree(tier).tokens_per_round(tier.steps)

    def unlearnt(self, tier: TreeShape) -> bool:
        """A tree none of whose rounds has run in this regime: its acceptance is a guess."""
        return not tier.is_chain and (tier not in self.trees or self.trees[tier].trials == 0)

    def ceiling_per_round(self, tier: TreeShape) -> float:
        """What `tier` could gain a request per round: an unlearnt tree's ceiling (the chains'
        rates at its topk candidates a depth), else its expectation."""
        if self.unlearnt(tier):
            return self.acceptance.tokens_per_round(tier.steps, tier.topk)
        return self.tokens_per_round(tier)

    def tokens_per_s(self, tier: int | TreeShape, batch_size: int) -> float | None:
        round_ms = self.cost.round_ms(tier, batch_size, self.tokens_per_round)
        if round_ms is None:
            return None
        return 1e3 * batch_size * self.tokens_per_round(tier) / round_ms
