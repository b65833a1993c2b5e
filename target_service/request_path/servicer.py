"""gRPC front of the target service: validate, hand to the scheduler, stream results back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from specpair.logging import bounded
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from specpair.rpc.serving import peer_host
from specpair.rpc.wire import apply_tier_from_proto, stats_to_proto
from specpair.runtime.build import StateBuilder
from specpair.runtime.shape import tier_name
from target_service.batching.scheduler import QueueFullError, Scheduler
from target_service.request_path.frontend import (
    DeadlineExceededError,
    Frontend,
    NotReadyError,
    RoundFailedError,
)
from target_service.request_path.request import from_proto
from target_service.request_path.validation import InvalidRequestError, check_sizes

SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
OPS_METHODS = [f"/{SERVICE.full_name}/{m}" for m in ("ApplyTier", "WatchRounds")]
# What the API key guards, as it guards HTTP /v1/ (GetServerInfo stays open, as /health does:
# the controller reads it with the ops token).
CLIENT_METHODS = [f"/{SERVICE.full_name}/Generate"]


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
        state = (
            target_pb2.DRAFT_CONNECTION_STATE_NONE
            if cfg.draft_address is None
            else (link.state if link else target_pb2.DRAFT_CONNECTION_STATE_CONNECTING)
        )
        tier = s.tier if s else cfg.initial_tier
        return target_pb2.TargetServiceGetServerInfoResponse(
            speculative_num_steps=tier.steps,
            shape=tier_name(tier),
            avg_spec_accept_length=s.avg_accept_length if s else 0.0,
            candidate_steps=list(cfg.candidate_steps),
            tree_shapes=list(cfg.tree_shapes),
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
        queue = scheduler.feed.watch(peer_host(context.peer() or ""))
        try:
            while not isinstance(stats := await queue.get(), str):
                yield target_pb2.WatchRoundsResponse(round=stats_to_proto(stats))
        finally:
            scheduler.feed.unwatch(queue)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, stats)
