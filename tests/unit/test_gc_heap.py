"""`specpair/rpc/gc_heap.py`: the collector's pauses counted and exported, and the heap frozen
only where a service process armed it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specpair.rpc import gc_heap
from specpair.rpc.metrics import ServiceMetrics


@pytest.fixture
def no_automatic_collections() -> Iterator[None]:
    """Only the test's own collections run (one the allocator triggered would add a count)."""
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Starts and leaves this test process's heap unfrozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels.get("generation", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_each_full_collection_is_counted_with_its_time(no_automatic_collections: None) -> None:
    gc_heap.count_pauses()
    gc_heap.count_pauses()  # once, however often called
    assert gc.callbacks.count(gc_heap._on_collection) == 1
    _, before, before_s = gc_heap.pauses()[2]
    gc.collect()
    gc.collect()
    generation, after, after_s = gc_heap.pauses()[2]
    assert generation == 2 and after == before + 2
    assert after_s > before_s  # a full walk of this process's heap takes measurable time


def test_a_services_exporter_carries_the_pauses_and_the_frozen_count(
    no_automatic_collections: None,
) -> None:
    registry = ServiceMetrics("draft").registry
    gc.collect()
    got = samples(registry)
    count = got[("specpair_draft_gc_collections_total", "2")]
    assert count == gc_heap.pauses()[2][1] >= 1
    assert got[("specpair_draft_gc_pause_seconds_total", "2")] > 0
    assert got[("specpair_draft_gc_frozen_objects", "")] == gc.get_freeze_count()


def test_the_heap_is_frozen_once_and_only_where_armed(unfrozen: None) -> None:
    assert gc_heap.serving() is None  # not armed: a test or an embedding keeps its heap
    assert gc.get_freeze_count() == 0
    with gc_heap.freeze_when_serving():
        took = gc_heap.serving()
        assert took is not None and took > 0
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # this process's modules at least
        # a full collection now skips them: it walks far fewer objects than were frozen
        assert len(gc.get_objects()) < frozen
        assert gc_heap.serving() is None  # once: a second service in the process does not
    gc.unfreeze()
    with gc_heap.freeze_when_serving():
        pass  # a `serve` that failed before SERVING (a taken port)
    assert gc_heap.serving() is None  # leaves nothing armed behind it
    assert gc.get_freeze_count() == 0
