"""How long the target waits for a draft replica's answer, and how long a late replica sits out.

The deadline follows the measured draft: `MULTIPLE` times a high percentile of the replica's
recent round times (the pool's fastest replica's, so a slow replica is judged against a live
one), never under `floor_s` and never over the configured `draft_timeout_s`. Worked example:
rounds of 20 ms at batch 4 (5 ms an input): a round of 4 gets max(4 · 20, 4 · 5 · 4) = 80 ms,
below a 1 s floor, so 1 s; a round of 64 inputs gets 4 · 5 · 64 = 1.28 s. Before `MIN_ROUNDS`
are measured, and for a round that carries a prompt (an input appending more than a tree
holds: a first round, a hand-off, a re-prefill after a move), the ceiling applies and the
round is not measured.

A replica that misses its deadline is *benched*: its stream is dropped, its requests move to a
live replica (or decode plainly), and it is let back only when a probe (an empty round on a new
stream) is answered within the deadline. Each miss or failed probe is a strike; the wait before
the next probe is `bench_s(strikes)`: 0.2 s after one (one slow round costs a round's drafts
and a probe's round trip, not half a minute), doubling to `MAX_BENCH_S`; `HEALTHY_ROUNDS`
answered in time clear the strikes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

MULTIPLE = 4.0  # the deadline is this many times the percentile below
PERCENTILE = 0.95
WINDOW = 128  # round times kept per replica
MIN_ROUNDS = 8  # rounds measured before the deadline follows them
MAX_BENCH_S = 30.0  # the longest a late replica waits for its next probe
HEALTHY_ROUNDS = 64  # rounds answered in time that clear a replica's strikes


class RoundPace:
    """One replica's recent answer times: whole rounds, and per input (a batch that grows
    takes longer; one that shrinks is bounded by its round time)."""

    def __init__(self) -> None:
        self.rounds: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.per_input: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, seconds: float, inputs: int) -> None:
        self.rounds.append(seconds)
        self.per_input.append(seconds / max(inputs, 1))

    def high(self, inputs: int) -> float | None:
        """The percentile's round time for a round of `inputs`; None before MIN_ROUNDS."""
        if len(self.rounds) < MIN_ROUNDS:
            return None
        return max(_percentile(self.rounds), _percentile(self.per_input) * max(inputs, 1))


def deadline(paces: Iterable[RoundPace], inputs: int, floor_s: float, ceiling_s: float) -> float:
    """The wait for an answer to a round of `inputs`: MULTIPLE times the fastest measured pace,
    within [floor_s, ceiling_s]; the ceiling while none is measured."""
    known = [h for pace in paces if (h := pace.high(inputs)) is not None]
    if not known:
        return ceiling_s
    return min(ceiling_s, max(floor_s, MULTIPLE * min(known)))


def bench_s(strikes: int, first_s: float) -> float:
    """The wait before probing a replica with `strikes` (>= 1): first_s, doubling, capped."""
    return min(MAX_BENCH_S, first_s * 2 ** min(strikes - 1, 16))


def _percentile(values: collections.deque[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(PERCENTILE * len(ordered)))]
