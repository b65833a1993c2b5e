"""Python's cyclic garbage collector in a serving process: its pauses counted, and the heap that
start-up made frozen once the process serves.

Start-up leaves some 400-530 k objects that live as long as the process: the modules (torch,
transformers, grpc), the model's modules, the tiers' states. A full collection (generation 2)
walks every one of them: 150 ms on a 2-core dev CPU, 224-254 ms on an H200's host (the draft's
and the target's collection before their freeze). CPython runs one once the objects that
survived the younger generations since the last reach a quarter of the long-lived ones: rarely
(none came in any cell of `bench.up_client` at 1-64 clients, each service's pauses 0-67 ms a
cell; bench/RESULTS.md, "The collector frozen"), but when one comes it holds a round for its whole
walk. `gc.freeze()` moves every object alive to a permanent generation that collections skip,
so after it a full collection walks only what serving has made since. Frozen objects are still
freed by reference counting when dropped; only a cycle among them is never collected, which
start-up's objects, living as long as the process, do not form in numbers that matter.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GENERATIONS = 3
_seconds = [0.0] * GENERATIONS  # the process's collector pauses by generation
_collections = [0] * GENERATIONS
_started = 0.0
_armed = False  # inside `freeze_when_serving`: the next `serving` freezes the heap


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    """`gc.callbacks`: times each collection (they never nest; the GIL is held throughout)."""
    global _started
    if phase == "start":
        _started = time.perf_counter()
        return
    generation = info["generation"]
    _seconds[generation] += time.perf_counter() - _started
    _collections[generation] += 1


def count_pauses() -> None:
    """Starts timing this process's collections (once, however often called)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def pauses() -> list[tuple[int, int, float]]:
    """(generation, collections, seconds) since `count_pauses`, generation 0 first."""
    return [(g, _collections[g], _seconds[g]) for g in range(GENERATIONS)]


class GcPauses(Collector):
    """Exports `pauses` as `{prefix}_gc_collections_total` and `{prefix}_gc_pause_seconds_total`,
    by generation, and the objects frozen as `{prefix}_gc_frozen_objects`: the process's, read
    when scraped."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        count_pauses()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        collections = CounterMetricFamily(
            f"{self.prefix}_gc_collections",
            "Collections by Python's cyclic garbage collector, by generation",
            labels=["generation"],
        )
        seconds = CounterMetricFamily(
            f"{self.prefix}_gc_pause_seconds",
            "Time Python's cyclic garbage collector held the process, by generation",
            labels=["generation"],
        )
        for generation, count, s in pauses():
            collections.add_metric([str(generation)], count)
            seconds.add_metric([str(generation)], s)
        yield collections
        yield seconds
        yield GaugeMetricFamily(
            f"{self.prefix}_gc_frozen_objects",
            "Objects in the collector's permanent generation (frozen once serving)",
            value=gc.get_freeze_count(),
        )


@contextmanager
def freeze_when_serving() -> Iterator[None]:
    """Within it, a service going SERVING freezes the heap (`serving`): `specpair serve` runs
    its service inside it. Services started elsewhere (the tests, an embedding), or after a
    `serve` that failed, leave their program's heap as it is."""
    global _armed
    _armed = True
    try:
        yield
    finally:
        _armed = False


def serving() -> float | None:
    """Called as a service goes SERVING: where armed, a full collection, then every object
    left is frozen (`gc.freeze`); returns the seconds it took, or None where not armed."""
    global _armed
    if not _armed:
        return None
    _armed = False
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0
