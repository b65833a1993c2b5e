"""Each finished round's account: stage timings to the metrics, RoundStats to every watcher.

WatchRounds (the controller, the benchmarks) reads a queue per watcher. Watchers cost the
round loop a queue put each per round, so there are at most `max_watchers`; one that falls a
whole queue behind is dropped (its stream ends, the controller reconnects) rather than kept at
the loop's expense.
"""

from __future__ import annotations

import asyncio
import collections
import time

from specpair.config import DEFAULT_MAX_WATCHERS
from specpair.metrics import ServiceMetrics
from specpair.runtime.round import RoundStats, StageTimings

QUEUE_ROUNDS = 1024


# What a watcher reads: each round's stats, then None once it was dropped.
WatchQueue = asyncio.Queue[RoundStats | None]


class RoundFeed:
    def __init__(self, metrics: ServiceMetrics, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        self.metrics = metrics
        self.max_watchers = max_watchers
        self._watchers: set[WatchQueue] = set()
        self.pipelined = False  # the last round was
        self.recent_hits: collections.deque[bool] = collections.deque(maxlen=256)

    @property
    def hit_rate(self) -> float:
        """Pipelined request-rounds whose tree was pre-drafted, over the last 256."""
        return sum(self.recent_hits) / len(self.recent_hits) if self.recent_hits else 0.0

    def watch(self) -> WatchQueue | None:
        """A new watcher's queue, or None when `max_watchers` are watching."""
        if len(self._watchers) >= self.max_watchers:
            return None
        queue: WatchQueue = asyncio.Queue(maxsize=QUEUE_ROUNDS)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: WatchQueue) -> None:
        self._watchers.discard(queue)

    def publish(
        self,
        round_id: int,
        tier: int,
        batch_size: int,
        accepts: list[int],
        speculative: bool,
        draft: StageTimings,
        *,
        rtt_s: float,
        verify_s: float,
        verify_gpu_ms: float,
        total_s: float,
        request_ids: list[str] | None = None,
        request_steps: list[int] | None = None,
        plain_request_ids: list[str] | None = None,
        predrafted: list[bool] | None = None,
        predraft_misses: int = 0,
        pipelined: bool = False,
        sampled_requests: int = 0,
        wait_s: float = 0.0,
        predraft_ms: float = 0.0,
        admit_s: float = 0.0,
    ) -> None:
        """One round: `draft` is the draft service's own account, `rtt_s` the time from its
        request going out to its trees, `total_s` the round's share of the wall time."""
        rpc_ms = 1e3 * rtt_s - draft.total_ms - draft.draft_host_ms
        timings = StageTimings(
            draft_ms=draft.draft_ms,
            extend_ms=draft.extend_ms,
            draft_host_ms=draft.draft_host_ms,
            draft_gpu_ms=draft.draft_gpu_ms,
            verify_ms=1e3 * verify_s,
            verify_gpu_ms=verify_gpu_ms,
            rpc_ms=max(rpc_ms, 0.0) if speculative else 0.0,
            schedule_ms=1e3 * max(total_s - rtt_s - verify_s - admit_s, 0.0),
            total_ms=1e3 * total_s,
            wait_ms=1e3 * wait_s,
            predraft_ms=predraft_ms,
            admit_ms=1e3 * admit_s,
        )
        for stage, ms in (("draft", timings.draft_ms), ("verify", timings.verify_ms),
                          ("rpc", timings.rpc_ms), ("schedule", timings.schedule_ms)):  # fmt: skip
            self.metrics.stage_latency.labels(stage).observe(ms / 1e3)
        stats = RoundStats(
            round_id, tier, batch_size, tuple(accepts), speculative, timings, time.time(),
            tuple(request_ids or ()), tuple(request_steps or ()), tuple(plain_request_ids or ()),
            tuple(predrafted or ()), predraft_misses, pipelined, sampled_requests,
        )  # fmt: skip
        if pipelined:
            hits = sum(predrafted or ())
            self.metrics.predrafts.labels(str(tier), "hit").inc(hits)
            self.metrics.predrafts.labels(str(tier), "miss").inc(predraft_misses)
            self.recent_hits.extend([True] * hits + [False] * predraft_misses)
        self.metrics.stage_latency.labels("wait").observe(wait_s)
        self.pipelined = pipelined
        for queue in list(self._watchers):
            if queue.full():  # a whole queue behind: dropped, told so by a None
                self._watchers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
            else:
                queue.put_nowait(stats)
