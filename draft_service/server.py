"""gRPC front of the draft service: one Round stream per target, rounds through `Compute`
(decoded and encoded there by `DraftRounds.run`, through `specpair.rpc.wire`)."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from draft_service.rounds import DraftRounds, stream_target
from draft_service.warmup import warm_up
from specpair.config import DraftConfig, split_address
from specpair.logging import get_logger
from specpair.models.loading import load_tokenizer, tokenizer_fingerprint
from specpair.proto.v1 import draft_pb2
from specpair.rpc.channels import TARGET_METADATA
from specpair.rpc.metrics import ServiceMetrics
from specpair.rpc.serving import Compute, GrpcServer, bind_device, busy_wait, on_device, peer_host
from specpair.rpc.wire import WireRound, read_round, timings_into

log = get_logger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
# With an ops token set, only a peer presenting it (the target) may open a Round stream: an
# anonymous one could hold every draft slot.
PROTECTED_METHODS = (f"/{SERVICE_NAME}/Round",)
MAX_TARGET_CHARS = 128
# Without a token, the Round streams one peer host may hold open (a target holds one per
# replica, a second while it reconnects): a flood of streams is refused, not served.
MAX_HOST_STREAMS = 64


def target_identity(context: grpc.aio.ServicerContext, stream: int, authenticated: bool) -> str:
    """Who opens Round stream number `stream`, the name its slots are counted under. A stream
    that presented the ops token (`authenticated`) is the target it declares (its
    x-specpair-target metadata), or a target of its own when it declares none (its peer's
    address and number: channels of one process share a connection). Without a token anyone
    may declare any name, so a stream is its peer's host (`ipv4:10.0.0.7`): four streams
    inventing four names hold one share. Only [A-Za-z0-9._:[]-] are kept, so it never holds
    the '#' and '/' of the keys built from it."""
    peer = context.peer() or "anonymous"
    declared = str(dict(context.invocation_metadata() or ()).get(TARGET_METADATA, ""))
    name = (declared or f"{peer}-{stream}") if authenticated else peer_host(peer)
    return re.sub(r"[^A-Za-z0-9._:\[\]-]", "_", name)[:MAX_TARGET_CHARS]


class DraftServicer:
    """DraftService's methods (`add_draft_service` registers them)."""

    def __init__(self, config: DraftConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.rounds: DraftRounds | None = None  # set once weights and states are built
        self.metrics = metrics
        self.compute = Compute("draft-compute", config.threads, config.device)
        self.busy_poll_s = config.busy_poll_s
        self.open_streams: set[str] = set()
        self._ids = itertools.count()
        self.vocab_size, self.tokenizer_fingerprint = 0, ""  # set with `rounds`

    async def Round(
        self,
        request_iterator: AsyncIterator[WireRound],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[draft_pb2.RoundResponse]:
        rounds = self.rounds
        if rounds is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draft model is still loading")
        assert rounds is not None
        n = next(self._ids)
        authenticated = bool(self.config.server.ops_token)  # the interceptor checked it
        target = target_identity(context, n, authenticated)
        held = sum(1 for s in self.open_streams if stream_target(s) == target)
        if not authenticated and held >= MAX_HOST_STREAMS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{target} holds {MAX_HOST_STREAMS} Round streams (unauthenticated: no ops token)",
            )
        stream_id = f"{target}#{n}"
        self.open_streams.add(stream_id)
        log.info("round stream opened", stream=stream_id, peer=context.peer())
        # However the call ends gRPC runs its done callbacks, also when the peer vanishes while
        # this generator is suspended at a yield and nothing resumes it.
        context.add_done_callback(
            lambda _: asyncio.ensure_future(self._close_stream(rounds, stream_id))
        )
        requests = aiter(request_iterator)
        try:
            while True:
                try:  # after a round, poll for the next (it follows the target's verify)
                    message = await busy_wait(anext(requests), self.busy_poll_s)
                except StopAsyncIteration:
                    break
                received = time.perf_counter()
                answer = await self.compute(rounds.run, stream_id, message)
                held_ms = 1e3 * (time.perf_counter() - received)
                timings = replace(
                    answer.timings, draft_host_ms=max(held_ms - answer.timings.total_ms, 0.0)
                )
                timings_into(answer.message.timings, timings)
                request = answer.request
                self.metrics.active_tier.set(request.speculative_num_steps)
                self.metrics.stage_latency.labels("draft").observe(timings.total_ms / 1e3)
                yield answer.message
                if rounds.plans_ahead and not answer.refused:  # while the target verifies
                    await self.compute(rounds.prepare, stream_id, request)
        finally:
            await self._close_stream(rounds, stream_id)

    async def _close_stream(self, rounds: DraftRounds, stream_id: str) -> None:
        """Frees everything the stream held, once (its end and its done callback both call)."""
        if stream_id not in self.open_streams:
            return
        self.open_streams.discard(stream_id)
        log.info("round stream closed", stream=stream_id)
        # Queued behind any round of the stream still computing, so it frees that one's too.
        # Shielded: gRPC cancels a dead peer's handler again while this waits, and cancelling
        # an executor job that has not started yet drops it (8 slots per killed target).
        await asyncio.shield(self.compute(rounds.release_stream, stream_id))

    @property
    def streams(self) -> int:
        return len(self.open_streams)

    async def GetServerInfo(
        self,
        request: draft_pb2.DraftServiceGetServerInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> draft_pb2.DraftServiceGetServerInfoResponse:
        cfg = self.config
        return draft_pb2.DraftServiceGetServerInfoResponse(
            model_path=str(cfg.model_path),
            draft_kind=cfg.draft_kind,
            candidate_steps=list(cfg.candidate_steps),
            tree_shapes=list(cfg.tree_shapes),
            active_streams=self.streams,
            active_requests=self.rounds.active_requests if self.rounds else 0,
            runtime_state_builds=self.rounds.builder.builds if self.rounds else 0,
            device=cfg.device,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            feature_layers=self.rounds.feature_layers if self.rounds else [],
            targets=self.usage(),
        )

    def usage(self) -> list[draft_pb2.DraftTargetUsage]:
        """Per target with a stream open (or slots still held): its streams and slots."""
        held = self.rounds.usage() if self.rounds else {}
        streams: dict[str, int] = {}
        for stream_id in self.open_streams:
            target = stream_target(stream_id)
            streams[target] = streams.get(target, 0) + 1
        return [
            draft_pb2.DraftTargetUsage(target=t, streams=streams.get(t, 0), requests=held.get(t, 0))
            for t in sorted(streams.keys() | held.keys())
        ]


@dataclass
class RunningDraft:
    server: GrpcServer
    servicer: DraftServicer

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        self.servicer.compute.shutdown()


def tokenizer_identity(config: DraftConfig) -> str:
    """The fingerprint the target checks at connect; a head shipped without a tokenizer is
    known by its target's."""
    tokenizer = load_tokenizer(config.model_path)
    if tokenizer is None and config.target_path is not None:
        tokenizer = load_tokenizer(config.target_path)
    return tokenizer_fingerprint(tokenizer)


def add_draft_service(servicer: DraftServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with Round's requests read by `read_round` (their feature
    bytes a view of what arrived, not copied into the message and out again)."""
    handlers = {
        "Round": grpc.stream_stream_rpc_method_handler(
            servicer.Round,
            request_deserializer=read_round,
            response_serializer=draft_pb2.RoundResponse.SerializeToString,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=draft_pb2.DraftServiceGetServerInfoRequest.FromString,
            response_serializer=draft_pb2.DraftServiceGetServerInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start(config: DraftConfig) -> RunningDraft:
    """Binds the port (health NOT_SERVING), loads the model and states, then SERVING."""
    bind_device(config.device)  # this loop's thread runs every round's kernels
    server = GrpcServer(config.server, [SERVICE_NAME], protected_methods=PROTECTED_METHODS)
    metrics = ServiceMetrics("draft")
    servicer = DraftServicer(config, metrics)
    add_draft_service(servicer, server.server)
    # Both ports are taken before the model loads: a taken one fails in a second, not later.
    if config.server.metrics_address:
        metrics.serve(*split_address(config.server.metrics_address))
    await server.start()
    log.info("draft service listening", address=config.server.address, port=server.port)
    if not config.server.ops_token:
        log.warning(
            "no ops token: Round streams are not authenticated, so each peer host counts as one "
            "target and holds at most max_target_requests of the draft's slots (set "
            "SPECPAIR_OPS_TOKEN on the draft and its targets)",
            max_target_requests=config.max_target_requests,
            max_requests=config.max_requests,
        )
    try:
        rounds = await asyncio.to_thread(on_device(config.device, DraftRounds), config)
        # Every path a round takes, once, while health still says NOT_SERVING: what compiles
        # on first use (flashinfer's prefill, on a GPU) must not do so in a target's first
        # round. Off the loop (as the build), so health answers meanwhile.
        took = await asyncio.to_thread(on_device(config.device, warm_up), rounds)
        log.info(f"draft warm-up done in {took:.1f} s", s=round(took, 3))
        fingerprint = await asyncio.to_thread(tokenizer_identity, config)
    except BaseException:
        await server.stop(0)  # on this loop: see target_service.server.start
        raise
    servicer.rounds = rounds
    servicer.vocab_size, servicer.tokenizer_fingerprint = rounds.vocab_size, fingerprint
    await server.ready()
    log.info("draft service ready", tiers=list(rounds.states), kind=config.draft_kind)
    return RunningDraft(server, servicer)


async def serve(config: DraftConfig) -> None:
    running = await start(config)
    try:
        await running.server.server.wait_for_termination()
    finally:
        await running.stop()
