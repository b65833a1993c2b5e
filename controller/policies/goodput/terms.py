"""The goodput cost model's terms (`cost.py`): per tier and batch bucket, moving
averages of what rounds took, and how a round is read into them."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.policies.interface import RoundSample
from specpair.runtime.shape import TreeShape


@dataclass
class Ema:
    value: float = 0.0
    n: int = 0  # samples measured (a profiled seed counts 0)
    seeded: bool = False
    skipped: int = 0  # rounds not learnt (a request joined in them)
    # A tier's own time: the mean of its first 1/alpha rounds, then a moving average. Seeded
    # with its first round alone, the average keeps (1 − alpha)^(n − 1) of it (66 % after 5
    # at 0.1), and a tier's first round after a switch (or a re-measure) is its least typical.
    averaged: bool = False

    @property
    def known(self) -> bool:
        return self.n > 0 or self.seeded

    def add(self, x: float, alpha: float) -> None:
        if self.n >= 3:
            # A round that also admitted a request carries its prefill; clipping at twice the
            # estimate keeps one such spike from moving it far, a real slow-down still wins.
            x = min(x, 2.0 * self.value)
        weight = max(alpha, 1.0 / (self.n + 1)) if self.averaged and not self.seeded else alpha
        self.value = x if not self.known else (1.0 - weight) * self.value + weight * x
        self.n += 1


@dataclass
class Bucket:
    # per tier: the round's wall time
    round_ms: dict[TreeShape, Ema] = field(default_factory=dict)
    verify_ms: dict[TreeShape, Ema] = field(default_factory=dict)
    draft_step_ms: Ema = field(default_factory=Ema)  # a chain's draft time / its steps
    # a tree's draft time beyond its depth's chain, per extra node drafted ((s − 1)(topk − 1))
    draft_node_ms: Ema = field(default_factory=Ema)
    fixed_ms: Ema = field(default_factory=Ema)  # round trip − draft: wire + extend + host
    # schedule (admission, prefill, streaming) per token the round gave: a tier that gives
    # more tokens a round finishes, and so admits, more requests a round
    sched_token_ms: Ema = field(default_factory=Ema)
    # admission (joiners' prefill, `admit_ms`) per token the rounds gave, rounds without drafts
    # apart from rounds with: a drafted round's joiner is prefilled by the draft too
    admit_token_ms: dict[bool, Rate] = field(default_factory=dict)

    def admit_token(self, drafted: bool) -> float:
        """Admission ms per token of rounds with (or without) drafts; the other kind's where
        this one has none yet, 0 with neither."""
        rate = self.admit_token_ms.get(drafted) or self.admit_token_ms.get(not drafted)
        return rate.value if rate is not None else 0.0


@dataclass
class Rate:
    """Σ ms / Σ tokens over the last ~`WINDOW` rounds (a plain ratio before that): admission
    comes in spikes — a round with a joiner, then none for 30 at batch 1 — that a per-round
    average of the ratio would follow up and down."""

    ms: float = 0.0
    tokens: float = 0.0
    n: int = 0

    WINDOW = 256

    @property
    def value(self) -> float:
        return self.ms / self.tokens if self.tokens else 0.0

    def add(self, ms: float, tokens: int) -> None:
        self.n += 1
        keep = 1.0 - max(1.0 / self.WINDOW, 1.0 / self.n)
        self.ms, self.tokens = keep * self.ms + ms, keep * self.tokens + tokens


def uniform_round(sample: RoundSample) -> tuple[float, float, float]:
    """(total, draft, fixed round trip) ms of `sample` as if every request had run at its
    tier: the inverse of `CostModel.mixed_round_ms`, so that a round of mixed per-request tiers
    teaches the same terms. b = 4 at tier 7 with steps [7, 7, 1] and one plain request: draft
    6 ms did 15 of 28 request-steps → 11.2 ms; a fixed 6 ms for 3 requests → 8 ms."""
    fixed = max(sample.round_trip_ms - sample.draft_ms, 0.0)
    steps = (*sample.request_steps, *(0 for _ in sample.plain_request_ids))
    b, s, done = sample.batch_size, sample.steps, sum(sample.request_steps)
    # A tree round's requests cap its depth but each draft step forwards the whole frontier:
    # learnt as run.
    tree = sample.shape is not None and not sample.shape.is_chain
    if tree or s < 1 or len(steps) != b or not sample.request_steps or done >= b * s:
        return sample.total_ms - sample.admit_ms, sample.draft_ms, fixed
    draft = sample.draft_ms * b * s / done
    full_fixed = fixed * b / len(sample.request_steps)
    total = sample.total_ms - sample.admit_ms + (draft - sample.draft_ms) + (full_fixed - fixed)
    return total, draft, full_fixed


def named(tier: TreeShape) -> int | TreeShape:
    return tier.steps if tier.is_chain else tier


def extra_nodes(tier: TreeShape) -> int:
    """Nodes a tree's draft forwards beyond the chain of its depth: 4x4x16 → 3 · 3 = 9."""
    return max(tier.steps - 1, 0) * (tier.topk - 1)
