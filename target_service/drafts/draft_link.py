"""The target's one long-lived Round stream to a draft service (one replica of its
`DraftPool`), with reconnects.

It carries typed rounds (`RoundRequest` out, `RoundResponse` back; `specpair.rpc.wire` converts).
`send()`, `receive()` and `round()` never raise: a failed, late or broken round returns None,
the stream is dropped, and the link reconnects with exponential backoff (specpair.rpc.reconnect).
Each new stream is a new *epoch*: the draft lost every request's state, so the scheduler
re-sends their full token history (`DraftSession` sees the new epoch, through the pool's
stream keys).

Every new stream must first answer a probe (an empty round) within the deadline, so a draft
whose health says SERVING but which answers late or never is not connected. An answer later
than its deadline (`draft_deadline.py`: a multiple of the measured pace, between a floor and
`timeout_s`) benches the replica: dropped, probed again after `bench_s(strikes)`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import Tensor

from specpair.config import TLSConfig
from specpair.logging import get_logger
from specpair.proto.v1 import draft_pb2, draft_pb2_grpc, target_pb2
from specpair.rpc.channels import auth_metadata, target_metadata
from specpair.rpc.reconnect import ReconnectingLink
from specpair.rpc.serving import busy_wait
from specpair.rpc.wire import encode_request, response_from_proto
from specpair.rpc.wire_tensor import ring_into
from specpair.runtime.feature_ring import FeatureRing
from specpair.runtime.round_messages import RoundRequest, RoundResponse
from specpair.runtime.shape import MAX_TREE_NODES
from target_service.drafts.draft_deadline import HEALTHY_ROUNDS, RoundPace, bench_s, deadline

log = get_logger(__name__)
State = target_pb2.DraftConnectionState
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
ROUND_METHOD = f"/{DRAFT_SERVICE}/Round"


def _written(message: bytes) -> bytes:
    """A Round request's serializer: its bytes are written already (`encode_request`)."""
    return message


class IncompatibleDraftError(ConnectionError):
    """The draft answers but cannot serve this target (another vocabulary or tokenizer)."""


class LateDraftError(ConnectionError):
    """The draft missed a deadline (a round's answer, or a probe's): it is benched."""


@dataclass(slots=True)
class Out:
    """A message out on the stream, answered in the order sent."""

    round_id: int
    seq: int  # the stream's message count: tags its feature ring region
    inputs: int
    max_nodes: int  # the largest tree its shape allows (0: a hand-off or release wants none)
    request_ids: frozenset[str]
    since: float  # when it went out
    timed: bool  # an ordinary round's answer: its time feeds the pace, within a deadline
    # (else the ceiling: a prompt's extend, a release)


def carries_prompt(request: RoundRequest) -> bool:
    """A round whose answer includes extending a prompt (a first round, a hand-off, a
    re-prefill): waited for up to the ceiling, and not measured."""
    if request.inputs and request.tier.steps == 0:
        return True
    return any(len(item.appended) > MAX_TREE_NODES + 1 for item in request.inputs)


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
        deadline_floor_s: float = 1.0,
        token: str | None = None,
        vocab_size: int = 0,
        tokenizer_fingerprint: str = "",
        feature_layers: tuple[int, ...] = (),
        fp8_features: bool = False,
        feature_ring: Callable[[], FeatureRing] | None = None,
        identity: str = "",
        authority: str | None = None,
    ) -> None:
        super().__init__(
            address,
            name=f"draft-link {address}",
            tls=tls,
            backoff_min_s=backoff_min_s,
            backoff_max_s=backoff_max_s,
            authority=authority,
        )
        # What a draft must agree on (0 / "": not checked): its q ranges over our vocabulary
        # and its token ids mean what ours mean.
        self.vocab_size, self.tokenizer_fingerprint = vocab_size, tokenizer_fingerprint
        self.feature_layers = feature_layers  # the layers our features come from ((): final)
        self.fp8_features = fp8_features  # features sent as float8 scaled per row
        # Features by reference to an EAGLE draft that maps it (made at its first connect):
        # `ring_open` once the draft's probe answer read our token.
        self._make_ring = feature_ring
        self.ring: FeatureRing | None = None
        self.ring_open = False
        self._ring_said = ""
        self._seq = 0
        self.incompatible = ""  # why the draft last refused, shown in GetServerInfo
        self.timeout_s = timeout_s  # the ceiling of every deadline
        self.deadline_floor_s = deadline_floor_s
        self.pace = RoundPace()
        # Whose paces set the deadline: the pool's connected replicas (set by the pool).
        self.peers: Callable[[], Iterable[RoundPace]] = lambda: (self.pace,)
        self.strikes = 0  # deadlines missed (and probes failed) since HEALTHY_ROUNDS in time
        self._in_time = 0
        self._late = ""  # why the session ended benched
        self._out: deque[Out] = deque()
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

    def deadline(self, inputs: int) -> float:
        """How long to wait for the answer to an ordinary round of `inputs`."""
        return deadline(self.peers(), inputs, self.deadline_floor_s, self.timeout_s)

    async def _hold(self) -> None:
        await self._lost.wait()
        if self._late:
            raise LateDraftError(self._late)

    def _failed(self, exc: Exception, retry_s: float) -> float:
        if isinstance(exc, LateDraftError):
            # Benched: its requests move to a live replica (or decode plainly) meanwhile.
            self.state = State.DRAFT_CONNECTION_STATE_DISCONNECTED
            wait = bench_s(self.strikes, self.backoff[0])
            log.warning(
                "draft benched",
                address=self.address,
                reason=str(exc),
                strikes=self.strikes,
                probe_in_s=round(wait, 3),
            )
            return wait
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
        self._late = ""
        self._out.clear()
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
        # Round's requests go out as `encode_request` wrote them: the stub's serializer would
        # copy a round's features into a message and again into its bytes.
        rounds = channel.stream_stream(
            ROUND_METHOD,
            request_serializer=_written,
            response_deserializer=draft_pb2.RoundResponse.FromString,
        )
        info = await stub.GetServerInfo(
            draft_pb2.DraftServiceGetServerInfoRequest(), timeout=self.timeout_s
        )
        if reason := self.mismatch(info):
            raise IncompatibleDraftError(reason)
        self.incompatible = ""
        self.draft_kind = info.draft_kind
        self.ring_open = False
        if self.ring is not None:
            self.ring.reset()
        elif self._make_ring is not None and info.draft_kind == "eagle":
            self.ring = self._new_ring(self._make_ring)
        self._call = rounds(metadata=self.metadata)
        await self._probe(self._call)
        self.epoch += 1
        self.state = State.DRAFT_CONNECTION_STATE_CONNECTED
        log.info("draft connected", address=self.address, kind=info.draft_kind, epoch=self.epoch)

    async def _probe(self, call: grpc.aio.StreamStreamCall) -> None:
        """An empty round, answered within the deadline, or the stream is not taken: a draft
        whose health says SERVING may still answer late or never."""
        wait = self.deadline(0)
        probe = draft_pb2.RoundRequest(round_id=0)
        if self.ring is not None:
            ring_into(probe.feature_ring, self.ring.handle)
        try:
            async with asyncio.timeout(wait):
                await call.write(probe.SerializeToString())
                answer = await call.read()
        except TimeoutError:
            self.strike()
            raise LateDraftError(f"a probe was not answered within {wait:.2f} s") from None
        if answer is grpc.aio.EOF:
            raise ConnectionError("draft closed the stream")
        if answer.round_id != 0:
            raise ConnectionError(f"probe answered as round {answer.round_id}")
        if self.ring is not None:
            self._ring_answered(self.ring, answer)

    def _new_ring(self, make: Callable[[], FeatureRing]) -> FeatureRing | None:
        try:
            return make()
        except (RuntimeError, OSError, ValueError) as exc:  # out of memory, no memfd
            self._make_ring = None
            log.warning("no feature ring: features go to the draft as bytes", error=str(exc))
            return None

    def _ring_answered(self, ring: FeatureRing, answer: draft_pb2.RoundResponse) -> None:
        self.ring_open = answer.feature_ring_token == ring.token
        said = "shared" if self.ring_open else (answer.feature_ring_error or "token mismatch")
        if said != self._ring_said:  # once, and again when it changes
            self._ring_said = said
            if self.ring_open:
                log.info(
                    "features shared with the draft", address=self.address, rows=ring.space.rows
                )
            else:
                log.info("features sent as bytes: the draft cannot map the ring", reason=said)

    def strike(self) -> None:
        self.strikes += 1
        self._in_time = 0

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
        self._seq += 1
        shared: list[int | None] = []
        if self.ring_open and self.ring is not None and request.inputs:
            features = [f if isinstance(f := i.features, Tensor) else None for i in request.inputs]
            shared = self.ring.put(self._seq, features)
        message = encode_request(request, self.fp8_features, shared)
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.write(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(request.round_id, exc, call, late=isinstance(exc, TimeoutError))
            return None
        ids = frozenset(item.request_id for item in request.inputs)
        timed = bool(request.inputs) and not carries_prompt(request)  # releases: no drafting
        shape_nodes = request.tier.num_draft_tokens
        now = time.perf_counter()
        self._out.append(Out(request.round_id, self._seq, len(ids), shape_nodes, ids, now, timed))
        return self.epoch

    async def receive(self, round_id: int, epoch: int) -> RoundResponse | None:
        """The trees of the round sent in `epoch`, within its deadline; None on any failure.
        The deadline counts from this call (the target's own work meanwhile is not the
        draft's lateness)."""
        call = self._call
        if not self.connected or call is None or epoch != self.epoch:
            return None  # that stream is gone, and its answer with it
        while self._out and self._out[0].round_id != round_id:
            self._out.popleft()  # never read (nothing leaves one so): forgotten
        if not self._out:
            return None
        out = self._out[0]
        wait = self.deadline(out.inputs) if out.timed else self.timeout_s
        try:
            try:
                async with asyncio.timeout(wait):
                    response = await busy_wait(call.read(), self.busy_poll_s)
            except TimeoutError:
                raise LateDraftError(f"round {round_id} not answered within {wait:.2f} s") from None
            if response is grpc.aio.EOF:
                raise ConnectionError("draft closed the stream")
            if response.round_id != round_id:
                raise ConnectionError(f"round {response.round_id} answered for {round_id}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(round_id, exc, call, late=isinstance(exc, LateDraftError))
            return None
        self._answered(out)
        return response_from_proto(response, out.max_nodes, out.request_ids)

    def _answered(self, out: Out) -> None:
        if out.timed:
            self.pace.add(time.perf_counter() - out.since, out.inputs)
        self._out.popleft()
        if self.ring is not None:
            self.ring.release(out.seq)  # the draft copied its rows out before answering
        self._in_time += 1
        if self._in_time >= HEALTHY_ROUNDS:
            self.strikes = 0

    async def round(self, request: RoundRequest) -> RoundResponse | None:
        """Sends one round and waits for its trees; None on any failure."""
        epoch = await self.send(request)
        return None if epoch is None else await self.receive(request.round_id, epoch)

    async def _fail(
        self, round_id: int, exc: Exception, call: grpc.aio.StreamStreamCall, *, late: bool
    ) -> None:
        if call is not self._call:
            # A round still out on a stream already replaced: dropping now would cut the new
            # stream (and every round on it) for a failure that is already handled.
            log.info("round on a replaced stream failed", round_id=round_id, error=repr(exc))
            return
        # Late, broken or crashed: drop the stream (its state is unknown) and reconnect; a late
        # one is benched (`_hold` raises, `_failed` says when it is probed).
        log.warning("draft round failed", round_id=round_id, error=repr(exc))
        if late:
            self.strike()
            self._late = str(exc)
        self.state = State.DRAFT_CONNECTION_STATE_DISCONNECTED
        await self._drop()
        self._lost.set()
