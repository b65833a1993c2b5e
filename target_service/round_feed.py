"""Each finished round's account: stage timings to the metrics, RoundStats to every watcher.

WatchRounds (the controller, the benchmarks) reads a queue per watcher. Watchers cost the
round loop a queue put each per round, so there are at most `max_watchers`; one that falls a
whole queue behind is dropped (its stream ends, the controller reconnects) rather than kept at
the loop's expense.
"""

from __future__ import annotations

import asyncio

from specpair.config import DEFAULT_MAX_WATCHERS
from specpair.metrics import ServiceMetrics
from specpair.runtime.round import RoundStats

QUEUE_ROUNDS = 1024


# What a watcher reads: each round's stats, then None once it was dropped.
WatchQueue = asyncio.Queue[RoundStats | None]


class RoundFeed:
    def __init__(self, metrics: ServiceMetrics, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        self.metrics = metrics
        self.max_watchers = max_watchers
        self._watchers: set[WatchQueue] = set()

    def watch(self) -> WatchQueue | None:
        """A new watcher's queue, or None when `max_watchers` are watching."""
        if len(self._watchers) >= self.max_watchers:
            return None
        queue: WatchQueue = asyncio.Queue(maxsize=QUEUE_ROUNDS)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: WatchQueue) -> None:
        self._watchers.discard(queue)

    def publish(self, stats: RoundStats) -> None:
        """One round's account (`runtime/target/round.py: round_stats`): its stage timings to
        the metrics, its stats to every watcher."""
        timings = stats.timings
        for stage, ms in (("draft", timings.draft_ms), ("verify", timings.verify_ms),
                          ("rpc", timings.rpc_ms), ("schedule", timings.schedule_ms)):  # fmt: skip
            self.metrics.stage_latency.labels(stage).observe(ms / 1e3)
        self.metrics.stage_latency.labels("wait").observe(timings.wait_ms / 1e3)
        for queue in list(self._watchers):
            if queue.full():  # a whole queue behind: dropped, told so by a None
                self._watchers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
            else:
                queue.put_nowait(stats)
