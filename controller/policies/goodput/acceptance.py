"""What a round at tier s yields: per-position acceptance of a chain draft, learnt online from
accept lengths and decayed so that it follows a workload that changes. The goodput policy's
other model, what a round costs, is `cost.py`."""

from __future__ import annotations

from collections.abc import Sequence


class AcceptanceModel:
    """Per-position acceptance of a chain draft, from accept lengths.

    p[i] is the chance that draft position i is accepted given that positions 1..i−1 were. A
    request that accepted a of s drafts tried positions 1..min(a + 1, s) and passed 1..a; so
    tier 3 with accept lengths [3, 1, 0] tried position 1 three times (passed 2), position 2
    twice (passed 1), position 3 once (passed 1): p = [2/3, 1/2, 1], pooled α = 4/6.

    Assumption (tested): p[i] does not depend on the tier the round ran at — a chain draft
    proposes the same first i tokens whatever s — so what tier 3 teaches predicts tier 1 and,
    for positions it never tries, the pooled rate α stands in (geometric acceptance):

        E[tokens per round](s) = 1 + Σ_{k=1..s} Π_{i≤k} p[i];  with p[i] = α: Σ_{k=0..s} α^k.

    Counts of the positions a round could try decay by (1 − decay) per accept length it brings
    (a round of 16 drafted requests: (1 − decay)^16), so the estimate spans about 1 / decay
    request-rounds at any batch size and follows a phase change within as many; rounds without
    drafts teach nothing and decay nothing.
    Each p[i] is shrunk toward α by `prior` pseudo-trials, and α toward `prior_alpha`.
    """

    def __init__(self, decay: float, *, prior: float = 2.0, prior_alpha: float = 0.5) -> None:
        self.decay, self.prior, self.prior_alpha = decay, prior, prior_alpha
        self._tried: list[float] = []  # index i − 1: decayed trials of position i
        self._passed: list[float] = []

    def observe(
        self, steps: int, accept_lengths: Sequence[int], request_steps: Sequence[int] = ()
    ) -> None:
        """`request_steps`: each length's own tier where per-request tiers differ (a request
        at tier 1 that accepted 1 never tried position 2), else every one ran at `steps`."""
        if steps < 1 or not accept_lengths:
            return
        # Only the positions this round could try decay: what tier 7 taught of positions 4–7
        # stands while the policy runs tier 3, instead of fading back to the pooled rate (which
        # over-predicts a long chain and draws repeated losing moves to a long tier).
        keep = (1.0 - self.decay) ** len(accept_lengths)
        for i in range(min(steps, len(self._tried))):
            self._tried[i] *= keep
            self._passed[i] *= keep
        while len(self._tried) < steps:
            self._tried.append(0.0)
            self._passed.append(0.0)
        own = request_steps if len(request_steps) == len(accept_lengths) else ()
        for j, a in enumerate(accept_lengths):
            s = own[j] if own else steps
            a = min(a, s)
            for i in range(min(a + 1, s)):
                self._tried[i] += 1.0
                self._passed[i] += 1.0 if i < a else 0.0

    def forget(self, trials: float) -> None:
        """Scales what was learnt down to at most `trials` decayed trials in all, rates kept:
        what follows then outweighs it at once (a probe asks whether drafts pay *now*)."""
        total = sum(self._tried)
        if total > trials > 0.0:
            scale = trials / total
            self._tried = [t * scale for t in self._tried]
            self._passed = [p * scale for p in self._passed]

    @property
    def alpha(self) -> float:
        """Pooled per-position acceptance."""
        tried, passed = sum(self._tried), sum(self._passed)
        return (passed + self.prior * self.prior_alpha) / (tried + self.prior)

    @property
    def trials(self) -> float:
        return sum(self._tried)

    def position_rates(self, steps: int) -> list[float]:
        alpha = self.alpha
        return [
            (self._passed[i] + self.prior * alpha) / (self._tried[i] + self.prior)
            if i < len(self._tried)
            else alpha
            for i in range(steps)
        ]

    def pooled_tail(self, more: int) -> float:
        """Drafts a chain that accepted every position so far is expected to accept in `more`
        further positions at the pooled rate α: α + α² + … + α^more. With α 0.82 and 4 more
        (tier 3 against 7): 0.82 + 0.67 + 0.55 + 0.45 = 2.50."""
        alpha = self.alpha
        return sum(alpha**k for k in range(1, more + 1))

    def tokens_per_round(self, steps: int, candidates: int = 1) -> float:
        """Expected tokens a request gains per round at tier `steps` (0: exactly 1).

        `candidates` > 1: a tree's ceiling, each of its depths offering that many drafts as
        independent tries at the chain's rate, passed with 1 − (1 − p)^k (a tree's other
        candidates are the draft's next-likeliest tokens, less likely than its first): with p
        = 0.5 at every position, steps 4, topk 4: 1 + 0.94 + 0.88 + 0.82 + 0.77 = 4.41 tokens,
        the chain of 4's 1.94."""
        total, reach = 1.0, 1.0
        for p in self.position_rates(steps):
            reach *= 1.0 - (1.0 - p) ** candidates
            total += reach
        return total
