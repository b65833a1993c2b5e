"""The controller's link to one target: GetServerInfo, then its WatchRounds stream, reconnected
with backoff (specpair.rpc.reconnect) for as long as the controller runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import grpc

from specpair.config import TLSConfig
from specpair.logging import Repeats, bounded, get_logger
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from specpair.rpc.channels import auth_metadata
from specpair.rpc.reconnect import ReconnectingLink
from specpair.rpc.wire import apply_tier_to_proto, stats_from_proto
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import ShapeError, TreeShape
from specpair.tier_estimate import RegimeSteps

log = get_logger("controller")
RPC_TIMEOUT_S = 5.0
# First retry after a failure; doubles up to ControllerConfig.reconnect_s.
FIRST_BACKOFF_S = 0.05


class NotConnectedError(ConnectionError):
    """An ops call to a target the link is not connected to."""


class TargetLink(ReconnectingLink):
    """Calls `on_connect(info)` once a target answers (raising there fails the attempt), then
    `on_round(stats)` for each round it reports (typed: `specpair.rpc.wire` decodes it), and
    `on_lost()` when the session ends."""

    def __init__(
        self,
        address: str,
        *,
        on_connect: Callable[[target_pb2.TargetServiceGetServerInfoResponse], Awaitable[None]],
        on_round: Callable[[RoundStats], Awaitable[None]],
        on_lost: Callable[[], None],
        tls: TLSConfig | None = None,
        token: str | None = None,
        backoff_max_s: float = 1.0,
    ) -> None:
        super().__init__(
            address,
            name=f"follow {address}",
            tls=tls,
            backoff_min_s=min(FIRST_BACKOFF_S, backoff_max_s),
            backoff_max_s=backoff_max_s,
        )
        self.metadata = auth_metadata(token)
        self.on_connect, self.on_round, self.on_lost = on_connect, on_round, on_lost
        self.was_connected = False  # whether the session that just failed had connected
        # A target that keeps refusing (loading; every watcher place taken) is logged once in
        # a while, with how many attempts were left out, not on every retry.
        self.repeats = Repeats(30.0)
        self._stub: target_pb2_grpc.TargetServiceStub | None = None
        self._rounds: grpc.aio.UnaryStreamCall | None = None

    async def apply_tier(
        self,
        tier: TreeShape,
        reason: str,
        request_steps: Mapping[str, int] | None = None,
        regimes: RegimeSteps | None = None,
    ) -> target_pb2.ApplyTierResponse:
        """ApplyTier on the connected target (with per-request and per-regime tiers, where
        given); raises NotConnectedError or grpc.aio.AioRpcError. A tree goes as its steps in
        the int field and its shape beside it ("" for a chain)."""
        if self._stub is None:
            raise NotConnectedError(f"target {self.address} is not connected")
        request = apply_tier_to_proto(tier, reason, request_steps, regimes)
        return await self._stub.ApplyTier(  # type: ignore[no-any-return]
            request, metadata=self.metadata, timeout=RPC_TIMEOUT_S
        )

    async def _connect(self) -> None:
        self.was_connected = False
        stub = target_pb2_grpc.TargetServiceStub(self._open())
        info = await stub.GetServerInfo(
            target_pb2.TargetServiceGetServerInfoRequest(),
            metadata=self.metadata,
            timeout=RPC_TIMEOUT_S,
        )
        self._stub = stub
        await self.on_connect(info)
        self.was_connected = True

    async def _hold(self) -> None:
        assert self._stub is not None
        self._rounds = self._stub.WatchRounds(
            target_pb2.WatchRoundsRequest(), metadata=self.metadata
        )
        async for response in self._rounds:
            try:
                stats = stats_from_proto(response.round)
            except ShapeError as exc:  # only this round is lost to the policy
                log.warning("round dropped", target=self.address, error=str(exc))
                continue
            await self.on_round(stats)
        log.warning("round stream ended", target=self.address)

    def _failed(self, exc: Exception, retry_s: float) -> float:
        if isinstance(exc, grpc.aio.AioRpcError):
            left_out = self.repeats.due((self.was_connected, exc.code()))
            (log.debug if left_out is None else log.warning)(
                "target connection lost" if self.was_connected else "target unavailable",
                target=self.address,
                code=exc.code().name,
                details=bounded(exc.details() or ""),
                retry_in_s=round(retry_s, 3),
                left_out=left_out or 0,
            )
        else:
            # A bug or a malformed message must not end the controller's watch of a target.
            log.exception("target watch failed", target=self.address, retry_in_s=round(retry_s, 3))
        return retry_s

    def _detach(self) -> None:
        rounds, self._rounds, self._stub = self._rounds, None, None
        if rounds is not None:
            rounds.cancel()
        self.on_lost()
