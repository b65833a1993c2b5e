"""The target service's life: bind (health NOT_SERVING), load the model and its states,
connect the draft, serve (SERVING), and stop (`specpair serve target`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specpair.config import FeatureDType, TargetConfig, is_loopback, split_address
from specpair.logging import get_logger
from specpair.models.args import ModelArgs
from specpair.models.loading import load_tokenizer, tokenizer_fingerprint
from specpair.parallel.build import build_parallel_states, build_parallel_target
from specpair.parallel.ranks import RankExitedError, RankGroup
from specpair.proto.v1 import target_pb2_grpc
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.build import StateBuilder, build_target
from specpair.runtime.feature_ring import FeatureRing
from specpair.runtime.shape import MAX_TREE_NODES
from specpair.runtime.target.warmup import warm_up
from target_service.batching.scheduler import Scheduler
from target_service.batching.usage import kv_cache_usage, log_throughput
from target_service.drafts.draft_link import DraftLink
from target_service.drafts.draft_pool import DraftPool
from target_service.http_door.http_api import HttpServer, OpenAIApp
from target_service.request_path.frontend import Frontend
from target_service.request_path.servicer import (
    CLIENT_METHODS,
    OPS_METHODS,
    SERVICE,
    TargetServicer,
)
from target_service.request_path.special_tokens import eos_ids, prompt_bos
from target_service.request_path.validation import request_bytes_limit

log = get_logger(__name__)


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
        """Until the server terminates; raises RankExitedError when a follower rank exits or
        hangs first (the target cannot compute without it; its requests in flight have
        already been answered with the message, and health says NOT_SERVING)."""
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
    log.info(
        "loading target weights",
        path=str(config.model_path),
        device=config.device,
        tensor_parallel=config.tensor_parallel,
    )
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
            config.model_path,
            tensor_parallel=config.tensor_parallel,
            threads=config.threads,
            on_exit=on_rank_exit,
            rank_timeout_floor_s=config.rank_timeout_floor_s,
            **options,
        )
    else:
        worker = build_target(config.model_path, **options)
    if ranks is not None:
        builder, states = build_parallel_states(worker, ranks.lockstep, config.tiers)
    else:
        builder = StateBuilder(worker)
        states = builder.build_all(config.tiers)
    # Every path a request's first rounds take, once, while health says NOT_SERVING: what
    # compiles on first use must not do so inside a user's first request.
    worker.ride_rows = config.ride_rows
    took = warm_up(worker, states)
    log.info(f"target warm-up done in {took:.1f} s", s=round(took, 3))
    scheduler = Scheduler(
        worker,
        states,
        initial_tier=config.initial_tier,
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        join_group=config.joins,
        max_watchers=config.max_watchers,
        draft=None,
        metrics=metrics,
        threads=config.threads,
        device=config.device,
        handoff=not config.no_prompt_handoff,
        handoff_ahead=not config.handoff_awaited,
        join_settle_s=config.join_settle_ms / 1e3,
        join_wait_s=config.join_wait_ms / 1e3,
        feed_at_tier_0=config.feed_draft_at_tier_0,
        draft_window=config.draft_window,
    )
    return scheduler, builder, ranks


async def start(config: TargetConfig) -> RunningTarget:
    """Binds the port (health NOT_SERVING), loads the model and states, then SERVING."""
    from specpair.rpc.serving import GrpcServer, bind_device, on_device

    bind_device(config.device)  # this loop's thread runs every round's kernels

    server = GrpcServer(
        config.server,
        [SERVICE.full_name],
        protected_methods=OPS_METHODS,
        max_request_bytes=request_bytes_limit(config.max_len),
        api_key=config.api_key,
        keyed_methods=CLIENT_METHODS,
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
            frontend,
            config.model_path.name,
            api_key=config.api_key,
            loopback=loopback,
            read_timeout_s=config.http_read_timeout_s,
        )
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

    going_down: set[asyncio.Task[None]] = set()  # health's NOT_SERVING, held till it is set

    def exited(message: str) -> None:
        if rank_exit.done():
            return
        rank_exit.set_result(message)
        frontend.fail(message)  # before the round fails: requests get why, not "see logs"
        going_down.add(loop.create_task(server.not_serving()))

    def on_rank_exit(message: str) -> None:  # a rank exited or hung (the watch, the watchdog)
        log.error(message)
        loop.call_soon_threadsafe(exited, message)

    try:
        built = await asyncio.to_thread(
            on_device(config.device, _build_scheduler), config, metrics, on_rank_exit
        )
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
        if rank_exit.done():  # a rank failed while loading or warming up: that is the cause
            raise RankExitedError(rank_exit.result()) from None
        raise
    if config.draft_address is not None:
        make_link = functools.partial(
            DraftLink,
            tls=config.server.tls,
            timeout_s=config.draft_timeout_s,
            deadline_floor_s=config.draft_deadline_floor_s,
            backoff_min_s=config.reconnect_min_s,
            backoff_max_s=config.reconnect_max_s,
            busy_poll_s=config.busy_poll_s,
            token=config.server.ops_token,
            vocab_size=scheduler.worker.model.args.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(frontend.tokenizer),
            feature_layers=config.feature_layers,
            fp8_features=config.feature_dtype is FeatureDType.FLOAT8,
            feature_ring=_ring_maker(config, scheduler.worker.model.args),
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


async def serve(config: TargetConfig) -> None:
    running = await start(config)
    try:
        await running.wait()
    finally:
        await running.stop()


def _ring_maker(config: TargetConfig, args: ModelArgs) -> Callable[[], FeatureRing] | None:
    """Makes a link's feature ring (`--feature-ring-mib`), of rows as wide as the features."""
    if config.feature_ring_mib == 0:
        return None
    width = args.hidden_size * max(len(config.feature_layers), 1)
    device = torch.device(config.device)
    size, dtype = config.feature_ring_mib << 20, getattr(torch, config.dtype)
    return functools.partial(FeatureRing.of_bytes, size, width, dtype, device)
