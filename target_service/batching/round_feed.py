"""Each finished round's account: stage timings to the metrics, RoundStats to every watcher.

WatchRounds (the controller, the benchmarks) reads a queue per watcher. Watchers cost the
round loop a queue put each per round, so there are at most `max_watchers`; one that falls a
whole queue behind is dropped (its stream ends, the controller reconnects) rather than kept at
the loop's expense. A newcomer always gets in: when every place is taken, the oldest watcher of
the peer host holding the most places is dropped for it, so watchers that hold places and read
nothing (an idle target drops nobody for falling behind) cannot lock a restarted controller
out, and a host flooding the places evicts its own first.
"""

from __future__ import annotations

import asyncio
import collections

from specpair.config import DEFAULT_MAX_WATCHERS
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.round_messages import RoundStats

QUEUE_ROUNDS = 1024


# What a watcher reads: each round's stats, then why it was dropped.
WatchQueue = asyncio.Queue[RoundStats | str]
BEHIND = f"this watcher fell {QUEUE_ROUNDS} rounds behind and was dropped; watch again"
EVICTED = "every max_watchers place was taken: this watcher, the oldest of its host's, was dropped"


class RoundFeed:
    def __init__(self, metrics: ServiceMetrics, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        self.metrics = metrics
        self.max_watchers = max_watchers
        self._watchers: dict[WatchQueue, str] = {}  # → its peer host, oldest first

    def watch(self, host: str = "") -> WatchQueue:
        """A new watcher's queue (`host`: its peer's), dropping the oldest watcher of the most
        crowded host when `max_watchers` are watching."""
        if len(self._watchers) >= self.max_watchers:
            crowded = collections.Counter(self._watchers.values()).most_common(1)[0][0]
            self._drop(next(q for q, h in self._watchers.items() if h == crowded), EVICTED)
        queue: WatchQueue = asyncio.Queue(maxsize=QUEUE_ROUNDS)
        self._watchers[queue] = host
        return queue

    def unwatch(self, queue: WatchQueue) -> None:
        self._watchers.pop(queue, None)

    def _drop(self, queue: WatchQueue, why: str) -> None:
        """Drops a watcher; its stream reads `why` next and ends."""
        self._watchers.pop(queue, None)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(why)

    def publish(self, stats: RoundStats) -> None:
        """One round's account (`runtime/target/target_round.py: round_stats`): its stage timings to
        the metrics, its stats to every watcher."""
        timings = stats.timings
        for stage, ms in (
            ("draft", timings.draft_ms),
            ("verify", timings.verify_ms),
            ("rpc", timings.rpc_ms),
            ("schedule", timings.schedule_ms),
        ):
            self.metrics.stage_latency.labels(stage).observe(ms / 1e3)
        self.metrics.stage_latency.labels("wait").observe(timings.wait_ms / 1e3)
        for queue in list(self._watchers):
            if queue.full():  # a whole queue behind: dropped, and told so
                self._drop(queue, BEHIND)
            else:
                queue.put_nowait(stats)
