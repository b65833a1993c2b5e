"""The goodput policy's cost model: what a round at tier s costs (time) at a batch size, learnt
online from RoundSamples' timings as moving averages that follow a workload that changes. What
a round yields is `acceptance.py`'s."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from controller.policies.goodput.least_squares import line_at, slope
from controller.policies.goodput.terms import (
    Bucket,
    Ema,
    Rate,
    extra_nodes,
    named,
    uniform_round,
)
from controller.policies.interface import RoundSample, as_tier
from specpair.runtime.shape import TreeShape, tier_name
from specpair.tier_estimate import TierEstimate

SEEN_REQUESTS = 4096  # ids kept to tell a request's first round: more than ever run at once


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share a cost estimate within a power of two: 1 | 2–3 | 4–7 | 8–15 | …"""
    return 1 << (max(batch_size, 1).bit_length() - 1)


class CostModel:
    """Round time vs tier and batch size: measured where measured, predicted elsewhere.

    Per batch bucket it keeps, per tier, the round's wall time, and for the differences between
    tiers a stage model: verify(s) per tier, plus for s > 0 a fixed draft round trip (wire,
    extend) and a draft time per step. An unmeasured tier s is predicted from the nearest
    measured tier r as T(r) + D(s) − D(r), D(s) = verify(s) + [s > 0]·(fixed + step·s). E.g.
    T(3) = 30 ms measured with verify 18, fixed 4, step 2: T(0) = 30 − (4 + 3·2) = 20 ms and
    T(7) = 30 + 4·2 = 38 ms (verify(s) held flat until two tiers are measured, then a line).
    A bucket with nothing measured borrows the nearest one that has.

    Tree shapes extend the stage model by what a tree adds: verify is a line in the tokens a
    request verifies (num_draft_tokens + 1: a chain's s + 1, a tree's n + 1), and the draft's
    steps after the first forward topk nodes each, (s − 1)(topk − 1) more than the chain of
    its depth, each costing `draft_node_ms` (learnt from tree rounds; before one, the verify
    line's slope, a token of the target's standing in for a node of the draft). A tree lies
    many verified tokens from the chains: where its bucket's verify line has one point, the
    nearest bucket's slope, scaled by the batch, stands in for the flat line (`_verify_slope`).
    So D(s, k, n) = verify(n + 1) + fixed + step·s + node·(s − 1)(k − 1), a chain's as above. E.g.
    batch 1, chains 3 and 7 measured with verify 18 and 22 ms (1 ms a token), step 2, fixed 4:
    4x4x16 = T(7) + (31 − 22) + 2·(4 − 7) + 1·9 = T(7) + 12 ms; at batch 64, with 6 ms a
    token, T(7) + 54 − 6 + 54 = T(7) + 102 ms: the slope that grows with the batch drops the tree.

    Given the tokens a request gains per round at each tier (`per_request`, the acceptance
    model's), D(s) also carries the schedule's share: sched per token · b · E(s). E.g. batch 16,
    tier 3: T = 174 ms (verify 31, draft 102 = 3 steps of 34, fixed 2.5, schedule 38.5 for
    16 · 2.82 tokens: 0.85 ms a token) → T(0) = 174 − 2.5 − 102 − 0.85·16·1.82 = 44.7 ms (69.5
    without the schedule term, which would charge tier 0 for streaming tier 3's 2.82 tokens).
    """

    def __init__(
        self, alpha: float, profile_ms: Iterable[tuple[int, int | TreeShape, float]] = ()
    ) -> None:
        self.alpha = alpha
        self._buckets: dict[int, Bucket] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # request ids met, oldest first
        for batch, steps, ms in profile_ms:
            tier = as_tier(steps)
            entry = self._bucket(batch_bucket(batch)).round_ms.setdefault(tier, Ema())
            entry.value, entry.seeded = ms, True

    def _bucket(self, key: int) -> Bucket:
        return self._buckets.setdefault(key, Bucket())

    def observe(self, sample: RoundSample) -> None:
        if sample.total_ms <= 0.0 or sample.batch_size < 1:
            return  # a target that reports no timings teaches nothing
        b, t, a = self._bucket(batch_bucket(sample.batch_size)), sample.tier, self.alpha
        s = t.steps
        tokens = sample.batch_size + sum(sample.accept_lengths)
        b.admit_token_ms.setdefault(sample.speculative, Rate()).add(sample.admit_ms, tokens)
        entry = b.round_ms.setdefault(t, Ema(averaged=True))
        if (self._joined(sample) or sample.admit_ms > 0) and entry.skipped < 3 * (entry.n + 1):
            # A request joined: its prefill is in admit_ms, its prompt's extend in its first
            # round (`_joined`, first: it records the ids); every request costs one admission
            # whatever the tier, so it is no tier's cost (a first round can take 5× a typical
            # one). Where one joins nearly every round (batch 64) 1 round in 4 is learnt, clipped.
            entry.skipped += 1
            return
        total, draft, fixed = uniform_round(sample)
        entry.add(total, a)
        b.verify_ms.setdefault(t, Ema(averaged=True)).add(sample.verify_ms, a)
        if s > 0:
            b.fixed_ms.add(fixed, a)
            if t.is_chain:
                b.draft_step_ms.add(draft / s, a)
            elif (nodes := extra_nodes(t)) and (step := self._draft_terms(b)[1]) is not None:
                b.draft_node_ms.add(max(draft - step * s, 0.0) / nodes, a)
        b.sched_token_ms.add(sample.schedule_ms / tokens, a)

    def _joined(self, sample: RoundSample) -> bool:
        """Whether a request of `sample` is met for the first time (its first round)."""
        ids = (*sample.request_ids, *sample.plain_request_ids)
        joined = any(rid not in self._seen for rid in ids)
        self._seen.update(dict.fromkeys(ids))
        while len(self._seen) > SEEN_REQUESTS:
            self._seen.popitem(last=False)
        return joined

    def forget(self, tier: int | TreeShape, batch_size: int) -> None:
        """Drops `tier`'s own round and verify times in this batch bucket: the rounds that
        follow set them afresh (until then the stage model predicts it). For a re-measure: a
        time learnt in a tier's first rounds and never since would otherwise outweigh them."""
        bucket, t = self._buckets.get(batch_bucket(batch_size)), as_tier(tier)
        if bucket is not None:
            bucket.round_ms.pop(t, None)
            bucket.verify_ms.pop(t, None)

    def _own(self, tier: int | TreeShape, batch_size: int) -> Ema | None:
        """`tier`'s round time in this batch bucket itself (no borrowing), if it has one."""
        bucket = self._buckets.get(batch_bucket(batch_size))
        return bucket.round_ms.get(as_tier(tier)) if bucket else None

    def measured(self, steps: int | TreeShape, batch_size: int) -> bool:
        """Whether `steps` has a time of its own (learnt or profiled) in this batch bucket."""
        entry = self._own(steps, batch_size)
        return entry is not None and entry.known

    def trusted(self, steps: int | TreeShape, batch_size: int) -> bool:
        """Whether `steps`'s time here rests on a profile or on 3 rounds of its own."""
        entry = self._own(steps, batch_size)
        return entry is not None and (entry.seeded or entry.n >= 3)

    def measured_rounds(self, steps: int | TreeShape, batch_size: int) -> int:
        entry = self._own(steps, batch_size)
        return entry.n if entry else 0

    def round_ms(
        self,
        steps: int | TreeShape,
        batch_size: int,
        per_request: Callable[[int | TreeShape], float] | None = None,
    ) -> float | None:
        """Predicted wall time of a round at tier `steps` for `batch_size`; None if unknown.
        `per_request(t)`: tokens a request gains per round at tier t, a chain named by its
        steps (then the schedule's share follows the tokens, and the round carries its share
        of admission: per token, as rounds with drafts or without pay it). The reference is the
        nearest measured tier by verified tokens, a chain before a tree. E.g. batch 64 (H100):
        tier 0 11.1 ms + 0.048 ms a token · 64 = 14.2; tier 3 27.2 + 0.101 · 64 · 2.9 = 46.0."""
        key = self._nearest_bucket(batch_bucket(batch_size))
        if key is None:
            return None
        b, tier = self._buckets[key], as_tier(steps)
        base = self._base_ms(b, tier, batch_size, per_request)
        if base is None or per_request is None:
            return base
        return base + b.admit_token(tier.steps > 0) * batch_size * per_request(named(tier))

    def _base_ms(
        self,
        b: Bucket,
        tier: TreeShape,
        batch_size: int,
        per_request: Callable[[int | TreeShape], float] | None,
    ) -> float | None:
        """`round_ms` in bucket `b` without admission."""
        known = {t: e.value for t, e in b.round_ms.items() if e.known}
        if tier in known:
            return known[tier]
        ref = min(known, key=lambda t: (abs(t.verified - tier.verified), not t.is_chain, t))
        # Between a tree and its reference lie many verified tokens: where this bucket's own
        # verify times give no slope, a borrowed one stands in (chains alone keep a flat line).
        borrow = not (tier.is_chain and ref.is_chain)
        d_steps, d_ref = self._stage_ms(b, tier, borrow), self._stage_ms(b, ref, borrow)
        if d_steps is None or d_ref is None:
            return None
        sched = 0.0
        if per_request is not None and b.sched_token_ms.n:
            gained = batch_size * (per_request(named(tier)) - per_request(named(ref)))
            sched = b.sched_token_ms.value * gained
        return max(known[ref] + d_steps - d_ref + sched, 1e-3)

    def mixed_round_ms(self, steps: Sequence[int]) -> float | None:
        """Predicted wall time of one round whose requests run at `steps` (one per request).

        The round runs at the largest tier m: its verify is m's (trees padded to m + 1), while
        the draft's work is each request's own: a request below m saves its share of the draft
        steps, one at 0 its share of the round trip too. With b = 4, m = 7, T(7) = 40 ms, a
        fixed round trip of 8 ms and 2 ms per draft step (batch-wide): steps [7, 7, 1, 0] take
        40 − 8·1/4 − 2·(7·4 − 15)/4 = 31.5 ms.
        """
        b, m = len(steps), max(steps, default=0)
        full = self.round_ms(TreeShape(m), b)
        key = self._nearest_bucket(batch_bucket(b))
        if full is None or key is None or m == 0:
            return full
        fixed, step = self._draft_terms(self._buckets[key])
        if fixed is None or step is None:
            return full
        idle = sum(1 for s in steps if s == 0)
        saved = fixed * idle / b + step * (b * m - sum(steps)) / b
        return max(full - saved, 1e-3)

    def _nearest_bucket(self, key: int) -> int | None:
        keys = [k for k, b in self._buckets.items() if any(e.known for e in b.round_ms.values())]
        if not keys:
            return None
        return min(keys, key=lambda k: (abs(k.bit_length() - key.bit_length()), k))

    def _stage_ms(self, b: Bucket, tier: TreeShape, borrow: bool = False) -> float | None:
        points = self._verify_points(b)
        x = tier.num_draft_tokens
        if borrow and len(points) < 2:
            per_token = self._verify_slope(b)
            x0, v0 = next(iter(points.items()), (x, 0.0))
            verify = v0 + per_token * (x - x0)
        else:
            verify, per_token = line_at(points, x), max(slope(points), 0.0)
        if tier.steps == 0:
            return verify
        fixed, step = self._draft_terms(b)
        if fixed is None or step is None:
            return None
        draft = step * tier.steps
        if nodes := extra_nodes(tier):
            node = b.draft_node_ms.value if b.draft_node_ms.n else per_token
            draft += node * nodes
        return verify + fixed + draft

    @staticmethod
    def _verify_points(b: Bucket) -> dict[int, float]:
        """Verify ms by tokens drafted per request (a chain's s, a tree's n)."""
        return {t.num_draft_tokens: e.value for t, e in b.verify_ms.items() if e.n}

    def _verify_slope(self, b: Bucket) -> float:
        """Verify ms per verified token of a request in bucket `b`: its own line's slope, else
        the nearest bucket's that has one, scaled by the batch (a request's token is a token
        of every request's forward): 0.2 ms at batch 1 → 6.4 ms at batch 32. 0 with none."""
        if len(points := self._verify_points(b)) >= 2:
            return max(slope(points), 0.0)
        own = next(k for k, o in self._buckets.items() if o is b)
        have = [k for k, o in self._buckets.items() if len(self._verify_points(o)) >= 2]
        if not have:
            return 0.0
        near = min(have, key=lambda k: abs(k.bit_length() - own.bit_length()))
        return max(slope(self._verify_points(self._buckets[near])), 0.0) * own / near

    def _draft_terms(self, b: Bucket) -> tuple[float | None, float | None]:
        """This bucket's draft terms, else the nearest bucket's that has them."""
        have = [k for k, o in self._buckets.items() if o.draft_step_ms.n]
        if b.draft_step_ms.n:
            return b.fixed_ms.value, b.draft_step_ms.value
        if not have:
            return None, None
        own = next(k for k, o in self._buckets.items() if o is b)
        near = self._buckets[min(have, key=lambda k: abs(k.bit_length() - own.bit_length()))]
        return near.fixed_ms.value, near.draft_step_ms.value


def tier_estimates(
    tiers: Iterable[TreeShape],
    cost: CostModel,
    tokens_per_round: Callable[[int | TreeShape], float],
    batch_size: int,
) -> tuple[TierEstimate, ...]:
    """tokens/s = batch · E[tokens/round] / round time for each tier of `tiers` whose round
    time `cost` can predict at `batch_size`; the others are left out. The goodput kind's
    (`ctl status`'s estimates), and the sglang kind's cost guard's."""
    out = []
    for t in tiers:
        round_ms = cost.round_ms(t, batch_size, tokens_per_round)
        if round_ms is None:
            continue
        e = tokens_per_round(t)
        out.append(
            TierEstimate(
                steps=t.steps,
                tokens_per_s=1e3 * batch_size * e / round_ms,
                round_ms=round_ms,
                tokens_per_round=e,
                observed_rounds=cost.measured_rounds(t, batch_size),
                shape=tier_name(t),
            )
        )
    return tuple(out)
