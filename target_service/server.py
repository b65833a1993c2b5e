"""gRPC front of the target service: validate, hand to the scheduler, stream results back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from specpair.config import TargetConfig, is_loopback, split_address
from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.models.loading import load_tokenizer, tokenizer_fingerprint
from specpair.parallel.build import build_parallel_target
from specpair.parallel.ranks import RankExitedError, RankGroup
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from specpair.runtime.build import StateBuilder, build_target
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.shape import MAX_TREE_NODES, tier_name
from specpair.serving import bounded
from specpair.wire import apply_tier_from_proto, stats_to_proto
from target_service.draft_link import DraftLink
from target_service.draft_pool import DraftPool
from target_service.frontend import (
    DeadlineExceededError,
    Frontend,
    NotReadyError,
    RoundFailedError,
)
from target_service.http_api import HttpServer, OpenAIApp
from target_service.request import from_proto
from target_service.round_feed import QUEUE_ROUNDS
from target_service.scheduler import QueueFullError, Scheduler
from target_service.special_tokens import eos_ids, prompt_bos
from target_service.validation import InvalidRequestError, check_sizes, request_bytes_limit

log = get_logger(__name__)
SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
OPS_METHODS = [f"/{SERVICE.full_name}/{m}" for m in ("ApplyTier", "WatchRounds")]


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Maps the shared request path (`Frontend`) and the ops calls onto gRPC."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self.builder: StateBuilder | None = None  # set once the states are built

    @property
    def scheduler(self) -> Scheduler | None:
        return self.frontend.scheduler

    async def _ready(self, context: grpc.aio.ServicerContext) -> Scheduler:
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target model is still loading")
        assert self.scheduler is not None
        return self.scheduler

    async def Generate(
        self, request: target_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.GenerateResponse]:
        remaining = context.time_remaining()
        try:
            self.frontend.ready()
            check_sizes(request, self.config.max_len)  # its lists counted before decoding
            client = from_proto(request)
            responses = self.frontend.generate(client, time_remaining=remaining)
            async with contextlib.aclosing(responses) as stream:
                async for response in stream:
                    yield response
        except NotReadyError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DeadlineExceededError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RoundFailedError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def GetServerInfo(
        self,
        request: target_pb2.TargetServiceGetServerInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> target_pb2.TargetServiceGetServerInfoResponse:
        cfg, s = self.config, self.scheduler
        link = s.draft if s else None
        state = target_pb2.DRAFT_CONNECTION_STATE_NONE if cfg.draft_address is None else (
            link.state if link else target_pb2.DRAFT_CONNECTION_STATE_CONNECTING
        )  # fmt: skip
        tier = s.tier if s else cfg.initial_tier
        return target_pb2.TargetServiceGetServerInfoResponse(
            speculative_num_steps=tier.steps,
            shape=tier_name(tier),
            avg_spec_accept_length=s.avg_accept_length if s else 0.0,
            candidate_steps=list(cfg.candidate_steps),
            tree_shapes=[str(t) for t in cfg.tiers if not t.is_chain],
            target_model_path=str(cfg.model_path),
            draft_address=cfg.draft_address or "",
            draft_connection_state=state,
            running_requests=len(s.running) if s else 0,
            queued_requests=len(s.queue) if s else 0,
            rounds=s.round_id if s else 0,
            runtime_state_builds=self.builder.builds if self.builder else 0,
            device=cfg.device,
            max_context_length=cfg.max_len,
            vocab_size=s.worker.model.args.vocab_size if s else 0,
            draft_incompatible_reason=link.incompatible if link else "",
            pipeline=bool(s and link and link.connected and s.pipelining),
            pipeline_hit_rate=s.feed.hit_rate if s else 0.0,
            draft_replicas=link.replicas() if link else [],
        )

    async def ApplyTier(
        self, request: target_pb2.ApplyTierRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ApplyTierResponse:
        scheduler = await self._ready(context)
        try:
            tier, own, regimes = apply_tier_from_proto(request)
            previous = scheduler.apply_tier(tier, request.reason or "ops", own, regimes)
        except ValueError as exc:  # ShapeError too: each names its field
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)))
        return target_pb2.ApplyTierResponse(
            previous_steps=previous.steps,
            previous_shape=tier_name(previous),
            speculative_num_steps=tier.steps,
            shape=tier_name(tier),
            current_round=scheduler.round_id,
        )

    async def WatchRounds(
        self, request: target_pb2.WatchRoundsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.WatchRoundsResponse]:
        scheduler = await self._ready(context)
        queue = scheduler.feed.watch()
        if queue is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_watchers} WatchRounds streams already open (max_watchers)",
            )
        assert queue is not None
        try:
            while (stats := await queue.get()) is not None:
                yield target_pb2.WatchRoundsResponse(round=stats_to_proto(stats))
        finally:
            scheduler.feed.unwatch(queue)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this watcher fell {QUEUE_ROUNDS} rounds behind and was dropped; watch again",
        )


@dataclass
class RunningTarget:
    server: Any  # GrpcServer
    servicer: TargetServicer
    task: asyncio.Task[None]
    http: HttpServer | None = None
    stats: asyncio.Task[None] | None = None
    ranks: RankGroup | None = None  # a tensor-parallel target's followers
    rank_exit: asyncio.Future[str] | None = None  # what `ranks` said when one exited

    async def wait(self) -> None:
        """Until the server terminates; raises RankExitedError when a follower rank exits
        first (the target cannot compute without it)."""
        if self.rank_exit is None:
            await self.server.server.wait_for_termination()
            return
        # Shielded, never cancelled: grpc's shutdown awaits the future this wait awaits.
        done = asyncio.shield(self.server.server.wait_for_termination())
        await asyncio.wait({done, self.rank_exit}, return_when=asyncio.FIRST_COMPLETED)
        if self.rank_exit.done():
            raise RankExitedError(self.rank_exit.result())

    @property
    def port(self) -> int:
        return int(self.server.port)

    @property
    def http_port(self) -> int:
        assert self.http is not None, "the HTTP API is disabled (http_address '')"
        return self.http.port

    async def stop(self, grace: float = 1.0) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        if self.stats is not None:
            self.stats.cancel()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(5.0):
                await self.task
        scheduler = self.servicer.scheduler
        if scheduler is not None:
            if scheduler.draft is not None:
                await scheduler.draft.close()
            scheduler.compute.shutdown()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.stop)


def _build_scheduler(
    config: TargetConfig, metrics: ServiceMetrics, on_rank_exit: Callable[[str], None]
) -> tuple[Scheduler, StateBuilder, RankGroup | None]:
    log.info("loading target weights", path=str(config.model_path), device=config.device,
             tensor_parallel=config.tensor_parallel)  # fmt: skip
    options: dict[str, Any] = dict(
        max_requests=config.max_batch,
        max_len=config.max_len + MAX_TREE_NODES + 1,  # headroom for a tree past the context
        keep_features=config.draft_address is not None,
        feature_layers=config.feature_layers,
        dtype=getattr(torch, config.dtype),
        device=config.device,
    )
    if config.deterministic:
        options["deterministic"] = True
    ranks = None
    if config.tensor_parallel > 1:
        worker, ranks = build_parallel_target(
            config.model_path, tensor_parallel=config.tensor_parallel, threads=config.threads,
            on_exit=on_rank_exit, **options,
        )  # fmt: skip
    else:
        worker = build_target(config.model_path, **options)
    builder = StateBuilder(worker)
    scheduler = Scheduler(
        worker,
        builder.build_all(config.tiers),
        initial_tier=config.initial_tier,
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        max_watchers=config.max_watchers,
        draft=None,
        metrics=metrics,
        threads=config.threads,
        device=config.device,
        pipeline=config.pipeline,
    )
    return scheduler, builder, ranks


async def start(config: TargetConfig) -> RunningTarget:
    """Binds the port (health NOT_SERVING), loads the model and states, then SERVING."""
    from specpair.serving import GrpcServer

    server = GrpcServer(
        config.server,
        [SERVICE.full_name],
        protected_methods=OPS_METHODS,
        max_request_bytes=request_bytes_limit(config.max_len),
    )
    metrics = ServiceMetrics("target")
    frontend = Frontend(config, metrics)
    servicer = TargetServicer(frontend)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server.server)
    # Both ports are taken before the model loads: a taken one fails in a second, not later.
    if config.server.metrics_address:
        metrics.serve(*split_address(config.server.metrics_address))
    await server.start()
    log.info("target service listening", address=config.server.address, port=server.port)
    http = None
    if config.http_address:  # answers 503 until the model is loaded, as health does
        loopback = is_loopback(split_address(config.http_address)[0])
        app = OpenAIApp(
            frontend, config.model_path.name, api_key=config.api_key, loopback=loopback,
            read_timeout_s=config.http_read_timeout_s,
        )  # fmt: skip
        http = HttpServer(app, config.http_address)
        await http.start()
        log.info(
            "OpenAI-compatible HTTP API listening", address=config.http_address, port=http.port
        )
        if not loopback and config.api_key is None:
            log.warning(
                "the HTTP API listens beyond loopback without an API key: anyone who reaches "
                "it may generate (set SPECPAIR_API_KEY or --api-key)",
                address=config.http_address,
            )
    scheduler: Scheduler | None = None
    ranks: RankGroup | None = None
    loop = asyncio.get_running_loop()
    rank_exit: asyncio.Future[str] = loop.create_future()

    def exited(message: str) -> None:
        if not rank_exit.done():
            rank_exit.set_result(message)

    def on_rank_exit(message: str) -> None:  # from the ranks' watch thread
        log.error(message)
        loop.call_soon_threadsafe(exited, message)

    try:
        built = await asyncio.to_thread(_build_scheduler, config, metrics, on_rank_exit)
        scheduler, servicer.builder, ranks = built
        frontend.tokenizer = await asyncio.to_thread(load_tokenizer, config.model_path)
        if config.eos_stop:
            frontend.eos = eos_ids(config.model_path, frontend.tokenizer)
        frontend.bos = prompt_bos(config.model_path, frontend.tokenizer)
    except BaseException:
        # Close the listeners on this loop: left to the garbage collector, grpc schedules
        # their shutdown on a closed loop and prints a second traceback after the real error.
        if http is not None:
            await http.stop()
        await server.stop(0)
        if scheduler is not None:
            scheduler.compute.shutdown()
        if ranks is not None:
            await asyncio.to_thread(ranks.stop)
        raise
    if config.draft_address is not None:
        make_link = functools.partial(
            DraftLink,
            tls=config.server.tls,
            timeout_s=config.draft_timeout_s,
            backoff_min_s=config.reconnect_min_s,
            backoff_max_s=config.reconnect_max_s,
            busy_poll_s=config.busy_poll_s,
            token=config.server.ops_token,
            vocab_size=scheduler.worker.model.args.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(frontend.tokenizer),
            feature_layers=config.feature_layers,
            identity=target_identity(config.server.address, server.port),
        )
        scheduler.draft = DraftPool(
            config.draft_addresses,
            lambda address, authority: make_link(address, authority=authority),
            resolve_s=config.draft_resolve_s,
        )
        await scheduler.draft.start()
    frontend.scheduler = scheduler
    metrics.kv_cache_usage.set_function(functools.partial(kv_cache_usage, scheduler.worker.cache))
    task = asyncio.create_task(scheduler.run(), name="scheduler")
    stats = None
    if config.stats_log_interval_s > 0:
        stats = asyncio.create_task(
            log_throughput(metrics, scheduler, config.stats_log_interval_s), name="stats"
        )
    await server.ready()
    log.info("target service ready", tiers=list(scheduler.states), draft=config.draft_address)
    exit_ = rank_exit if ranks is not None else None
    return RunningTarget(server, servicer, task, http, stats, ranks, exit_)


def target_identity(address: str, port: int) -> str:
    """How this target names itself to its drafts (they count its slots over all its streams):
    the host and the port it serves, `pod-7:50051`, unique on a host and in a cluster."""
    where = address if address.startswith("unix:") else str(port)
    return f"{socket.gethostname()}:{where}"


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


async def serve(config: TargetConfig) -> None:
    running = await start(config)
    try:
        await running.wait()
    finally:
        await running.stop()
