"""How busy the target is: its KV cache's use (a gauge, read when scraped) and a throughput
log line while there is work."""

from __future__ import annotations

import asyncio
import time

from specpair.logging import get_logger
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.kv_cache import KVCache
from target_service.batching.scheduler import Scheduler

log = get_logger(__name__)


def kv_cache_usage(cache: KVCache) -> float:
    """Pages requests hold over the pages they may hold: the padding slot of graph buckets
    holds a whole slot's pages from the start, and they are nobody's."""
    usable = cache.pages.num_pages - cache.pages_per_slot
    return (usable - len(cache.pages.free)) / usable


async def log_throughput(metrics: ServiceMetrics, scheduler: Scheduler, interval_s: float) -> None:
    """Every `interval_s` with work done or waiting, one line as vLLM's and SGLang's: prompt
    and generation tokens/s, running and queued requests, the KV cache's use. It reads the
    metrics' counters, so the round loop does nothing for it."""

    def totals() -> tuple[float, float]:
        sample = metrics.registry.get_sample_value
        return (
            sample("specpair_target_prompt_tokens_total") or 0.0,
            sample("specpair_target_generation_tokens_total") or 0.0,
        )

    last, t_last = totals(), time.perf_counter()
    while True:
        await asyncio.sleep(interval_s)
        now, t_now = totals(), time.perf_counter()
        busy = scheduler.running or scheduler.queue
        if now != last or busy:
            span = t_now - t_last
            log.info(
                "throughput",
                prompt_tokens_per_s=round((now[0] - last[0]) / span, 1),
                generation_tokens_per_s=round((now[1] - last[1]) / span, 1),
                running=len(scheduler.running),
                queued=len(scheduler.queue),
                kv_cache_usage=round(
                    metrics.registry.get_sample_value("specpair_target_kv_cache_usage") or 0.0, 3
                ),
                tier=str(scheduler.tier),
            )
        last, t_last = now, t_now
