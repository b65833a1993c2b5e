"""The target's one long-lived Round stream to a draft service (one replica of its
`DraftPool`), with reconnects.

It carries typed rounds (`RoundRequest` out, `RoundResponse` back; `specpair.wire` converts).
`send()`, `receive()` and `round()` never raise: a failed, late or broken round returns None,
the stream is dropped, and the link reconnects with exponential backoff (specpair.reconnect).
Each new stream is a new *epoch*: the draft lost every request's state, so the scheduler
re-sends their full token history (`DraftSession` sees the new epoch, through the pool's
stream keys).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpair.channels import auth_metadata, target_metadata
from specpair.config import TLSConfig
from specpair.logging import get_logger
from specpair.proto.v1 import draft_pb2, draft_pb2_grpc, target_pb2
from specpair.reconnect import ReconnectingLink
from specpair.runtime.round import RoundRequest, RoundResponse
from specpair.serving import busy_wait
from specpair.wire import request_to_proto, response_from_proto

log = get_logger(__name__)
State = target_pb2.DraftConnectionState
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class IncompatibleDraftError(ConnectionError):
    """The draft answers but cannot serve this target (another vocabulary or tokenizer)."""


class DraftLink(ReconnectingLink):
    def __init__(
        self,
        address: str,
        *,
        tls: TLSConfig | None = None,
        timeout_s: float = 5.0,
        backoff_min_s: float = 0.2,
        backoff_max_s: float = 5.0,
        busy_poll_s: float = 0.0,
        token: str | None = None,
        vocab_size: int = 0,
        tokenizer_fingerprint: str = "",
        feature_layers: tuple[int, ...] = (),
        fp8_features: bool = False,
        identity: str = "",
        authority: str | None = None,
    ) -> None:
        super().__init__(
            address, name=f"draft-link {address}", tls=tls, backoff_min_s=backoff_min_s,
            backoff_max_s=backoff_max_s, authority=authority,
        )  # fmt: skip
        # What a draft must agree on (0 / "": not checked): its q ranges over our vocabulary
        # and its token ids mean what ours mean.
        self.vocab_size, self.tokenizer_fingerprint = vocab_size, tokenizer_fingerprint
        self.feature_layers = feature_layers  # the layers our features come from ((): final)
        self.fp8_features = fp8_features  # features sent as float8 scaled per row
        self.incompatible = ""  # why the draft last refused, shown in GetServerInfo
        self.timeout_s = timeout_s
        # The ops token (a draft that has one asks for it), and who we are: the draft counts
        # this target's slots over all its streams.
        self.metadata = auth_metadata(token) + target_metadata(identity)
        self.busy_poll_s = busy_poll_s  # poll for the trees this long (serving.busy_wait)
        self.state: target_pb2.DraftConnectionState.ValueType = (
            State.DRAFT_CONNECTION_STATE_CONNECTING
        )
        self.epoch = 0
        self.draft_kind = ""
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lost = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self.state == State.DRAFT_CONNECTION_STATE_CONNECTED

    async def _hold(self) -> None:
        await self._lost.wait()

    def _failed(self, exc: Exception, retry_s: float) -> float:
        if isinstance(exc, IncompatibleDraftError):
            # Not a network blip: say so once, keep decoding plainly, and look again at the
            # slowest pace (a draft restarted with the right checkpoint is picked up).
            if self.incompatible != str(exc):
                log.error("draft refused", address=self.address, reason=str(exc))
            self.incompatible = str(exc)
            self.state = State.DRAFT_CONNECTION_STATE_INCOMPATIBLE
            return self.backoff[1]
        self.state = State.DRAFT_CONNECTION_STATE_DISCONNECTED
        log.warning("draft unreachable", address=self.address, error=str(exc), retry_s=retry_s)
        return retry_s

    async def _connect(self) -> None:
        self._lost.clear()
        channel = self._open()
        async with asyncio.timeout(self.timeout_s):  # see ReconnectingLink._drop: not wait_for
            await channel.channel_ready()
        # A draft still loading its model answers GetServerInfo but aborts Round: wait for
        # its health to say SERVING, or the first round fails on a stream already closed.
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=DRAFT_SERVICE), timeout=self.timeout_s
        )
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            raise ConnectionError("draft is not serving yet (loading its model)")
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        info = await stub.GetServerInfo(
            draft_pb2.DraftServiceGetServerInfoRequest(), timeout=self.timeout_s
        )
        if reason := self.mismatch(info):
            raise IncompatibleDraftError(reason)
        self.incompatible = ""
        self.draft_kind = info.draft_kind
        self._call = stub.Round(metadata=self.metadata)
        self.epoch += 1
        self.state = State.DRAFT_CONNECTION_STATE_CONNECTED
        log.info("draft connected", address=self.address, kind=info.draft_kind, epoch=self.epoch)

    def mismatch(self, info: draft_pb2.DraftServiceGetServerInfoResponse) -> str:
        """Why a draft reporting `info` cannot serve this target ("" when it can)."""
        if self.vocab_size and info.vocab_size and info.vocab_size != self.vocab_size:
            return (
                f"draft vocab_size {info.vocab_size} != target vocab_size {self.vocab_size}: "
                "its distributions would not range over the target's tokens"
            )
        ours, theirs = self.tokenizer_fingerprint, info.tokenizer_fingerprint
        if ours and theirs and ours != theirs:
            return (
                f"draft tokenizer {theirs} != target tokenizer {ours} (vocabulary hashes): "
                "the same id would mean different tokens"
            )
        wanted = tuple(info.feature_layers)
        if info.draft_kind == "eagle" and wanted != self.feature_layers:
            flag = ",".join(map(str, wanted))
            return (
                f"the draft's EAGLE-3 head reads target layers {list(wanted)}, this target sends "
                f"{list(self.feature_layers) or 'its final hidden state'}: start the target with "
                + (f"--feature-layers {flag}" if wanted else "no --feature-layers")
            )
        return ""

    def _detach(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def send(self, request: RoundRequest) -> int | None:
        """Writes one round, at most `timeout_s`; the stream's epoch, or None on any failure."""
        call = self._call
        if not self.connected or call is None:
            return None
        message = request_to_proto(request, self.fp8_features)
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(request.round_id, exc, call)
            return None
        return self.epoch

    async def receive(self, round_id: int, epoch: int) -> RoundResponse | None:
        """The trees of the round sent in `epoch`, at most `timeout_s`; None on any failure."""
        call = self._call
        if not self.connected or call is None or epoch != self.epoch:
            return None  # that stream is gone, and its answer with it
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await busy_wait(call.read(), self.busy_poll_s)
            if response is grpc.aio.EOF:
                raise ConnectionError("draft closed the stream")
            if response.round_id != round_id:
                raise ConnectionError(f"round {response.round_id} answered for {round_id}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(round_id, exc, call)
            return None
        return response_from_proto(response)

    async def round(self, request: RoundRequest) -> RoundResponse | None:
        """Sends one round and waits for its trees; None on any failure."""
        epoch = await self.send(request)
        return None if epoch is None else await self.receive(request.round_id, epoch)

    async def _fail(self, round_id: int, exc: Exception, call: grpc.aio.StreamStreamCall) -> None:
        if call is not self._call:
            # A round still out on a stream already replaced: dropping now would cut the new
            # stream (and every round on it) for a failure that is already handled.
            log.info("round on a replaced stream failed", round_id=round_id, error=repr(exc))
            return
        # Late, broken or crashed: drop the stream (its state is unknown) and reconnect.
        log.warning("draft round failed", round_id=round_id, error=repr(exc))
        self.state = State.DRAFT_CONNECTION_STATE_DISCONNECTED
        await self._drop()
        self._lost.set()
