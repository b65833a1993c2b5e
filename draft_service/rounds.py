"""The draft service's side of the round: the wire edge (`specpair.rpc.wire` decodes each
RoundRequest and encodes its RoundResponse), the checks a peer's round must pass, this cache's
room, then the draft's round itself (`runtime/draft/draft_round.py`: release → extend + draft →
respond).

Request ids are namespaced per Round stream, whose id names the target that opened it
(`TARGET#n`, keys `TARGET#n/REQUEST`): two targets sending the same request id, or a
reconnecting one, never share draft state; a stream's requests are freed when it ends; and a
target's slots are counted over all its streams, at most `max_target_requests`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specpair.config import DraftConfig
from specpair.logging import Repeats, bounded, get_logger
from specpair.models.loading import CheckpointError, eagle_layout
from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import (
    MalformedRequestError,
    WireRound,
    request_from_proto,
    response_to_proto,
)
from specpair.rpc.wire_tensor import ring_from_proto
from specpair.runtime.build import StateBuilder, build_drafter, feature_layers
from specpair.runtime.draft.draft_round import DraftRound, RoundError
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.drafters import EagleDrafter
from specpair.runtime.feature_ring import RingView
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.round_messages import DraftInput, RoundRequest, RoundResponse, StageTimings
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState, gpu_ms

__all__ = ["Answer", "DraftRounds", "RoundError"]
log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Answer:
    """One round off the wire: its request as decoded, its response encoded (on the compute
    thread: the cost is the draft's) and the draft's timings of it (zero when it drafted
    nothing: a release, or a refused round)."""

    request: RoundRequest
    message: draft_pb2.RoundResponse
    timings: StageTimings
    refused: bool = False


class DraftRounds:
    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        log.info("loading draft weights", path=str(config.model_path), kind=config.draft_kind)
        layout = eagle_layout(config.model_path)
        if (layout is not None) != (config.draft_kind == "eagle"):
            what = "an EAGLE head" if layout else "not an EAGLE head"
            raise CheckpointError(
                f"{config.model_path}: {what}, but --draft-kind is {str(config.draft_kind)!r} "
                "(an EAGLE head is served with --draft-kind eagle --target-model TARGET)"
            )
        self.drafter: Drafter = build_drafter(
            config.model_path,
            target_path=config.target_path if config.draft_kind == "eagle" else None,
            max_requests=config.max_requests,
            max_len=config.cache_len,
            dtype=getattr(torch, config.dtype),
            device=config.device,
            token_map=config.token_map,
        )
        self.vocab_size = self.drafter.args.vocab_size
        if config.token_map is not None:  # build_drafter refused it for any other draft
            assert isinstance(self.drafter, EagleDrafter)
            rows = self.drafter.head.lm_head.weight.shape[0]
            log.info(
                "drafting over a token map",
                path=str(config.token_map),
                ids=rows,
                of=self.vocab_size,
            )
        # What the target must send as features (GetServerInfo): () unless an EAGLE-3 head.
        self.feature_layers = (
            list(feature_layers(config.model_path, config.target_path))
            if layout is not None and config.target_path is not None
            else []
        )
        self.builder = StateBuilder(drafter=self.drafter, handoff_rows=config.handoff_rows)
        # Tier 0 (extend only: a target's prompt hand-off) is served whatever the tiers are.
        self.states: dict[TreeShape, SpecRuntimeState] = self.builder.build_all(
            {*config.tiers, TreeShape(0)}
        )
        self.round = DraftRound(self.drafter)
        self.headroom = max(t.draft_headroom for t in self.states)
        self.repeats = Repeats()  # a peer whose every round is refused logs once in a while
        self.rings: dict[str, RingView] = {}  # per stream: the target's feature ring, mapped

    @property
    def active_requests(self) -> int:
        return len(self.drafter.requests)

    def release_stream(self, stream_id: str) -> None:
        self.round.release_stream(stream_id)
        self.rings.pop(stream_id, None)

    def run(self, stream_id: str, wire: WireRound) -> Answer:
        """One round off the wire; errors in it come back in `error`, never as an exception."""
        t0 = time.perf_counter()
        message = wire.message
        if message.HasField("feature_ring"):
            return self._map_ring(stream_id, message)
        try:
            request = request_from_proto(message, self.rings.get(stream_id), wire.feature_data)
            response = self.draft(stream_id, request)
        except Exception as exc:
            request = exc.request if isinstance(exc, MalformedRequestError) else request
            return self._refuse(stream_id, request, exc)
        encoded = response_to_proto(response)
        if not request.inputs:
            return Answer(request, encoded, StageTimings())
        total = 1e3 * (time.perf_counter() - t0)  # encoding the trees included
        timings = StageTimings(
            draft_ms=total,
            extend_ms=1e3 * self.drafter.last_times[0],
            total_ms=total,
            draft_gpu_ms=gpu_ms(self.drafter),
        )
        return Answer(request, encoded, timings)

    def _map_ring(self, stream_id: str, message: draft_pb2.RoundRequest) -> Answer:
        """A probe with the target's feature ring: mapped, and answered with the token read
        from it, or with why not (the target then sends features as bytes)."""
        answer = draft_pb2.RoundResponse(round_id=message.round_id)
        request = RoundRequest(message.round_id, 0)
        if message.inputs or message.round_id != 0:
            answer.error = "feature_ring: only on a probe (round 0, no inputs)"
            return Answer(request, answer, StageTimings(), refused=True)
        try:
            ring = RingView(ring_from_proto(message.feature_ring), self.drafter.device)
        except Exception as exc:  # another host or GPU, a driver that refuses: bytes it is
            answer.feature_ring_error = bounded(f"{type(exc).__name__}: {exc}")
            return Answer(request, answer, StageTimings())
        self.rings[stream_id] = ring
        answer.feature_ring_token = ring.token
        return Answer(request, answer, StageTimings())

    def draft(self, stream_id: str, request: RoundRequest) -> RoundResponse:
        """The round's checks, then the draft's round at its tier, within this cache's room."""
        state = self._state(request.tier) if request.inputs else None
        self._check(request)
        return self.round.answer(
            request,
            state,
            stream=stream_id,
            room=lambda inputs, round_id: self._with_room(inputs, round_id, stream_id),
        )

    def _refuse(self, stream_id: str, request: RoundRequest, exc: Exception) -> Answer:
        """Bad input (RoundError, ValueError), no room (CacheFullError) or a bug: the target
        decodes this round plainly and re-sends these requests' full tokens, so their state
        here is dropped either way, and the stream and its other requests go on."""
        self.round.drop(request, stream_id)
        error = bounded(str(exc)) or type(exc).__name__
        bad_input = isinstance(exc, ValueError | CacheFullError)
        left_out = self.repeats.due((bad_input, stream_target(stream_id)))
        if left_out is not None and bad_input:
            log.warning("round rejected", round_id=request.round_id, error=error, left_out=left_out)
        elif left_out is not None:
            log.exception("round failed", round_id=request.round_id, left_out=left_out)
        message = response_to_proto(RoundResponse(request.round_id, error=error))
        return Answer(request, message, StageTimings(), refused=True)

    @property
    def plans_ahead(self) -> bool:
        """Whether `prepare` does anything: the drafter runs CUDA graphs."""
        return any(state.extend_stage().plans_ahead for state in self.states.values())

    def prepare(self, stream_id: str, request: RoundRequest) -> None:
        """Plans the next round of this round's requests at its tier (see Drafter.prepare)."""
        state = self.states.get(request.tier)
        if state is not None:
            ids = [f"{stream_id}/{item.request_id}" for item in request.inputs]
            self.drafter.prepare(ids, state)

    def _state(self, tier: TreeShape) -> SpecRuntimeState:
        state = self.states.get(tier)
        if state is None:
            name = "speculative_num_steps" if tier.is_chain else "shape"
            tiers = [str(t) for t in sorted(self.states)]
            raise RoundError(f"{name} {tier} is not a candidate tier {tiers}")
        return state

    def _check(self, request: RoundRequest) -> None:
        """Raises RoundError naming the first field this draft cannot serve."""
        ids = [item.request_id for item in request.inputs]
        if len(set(ids)) != len(ids):
            raise RoundError("inputs: a request_id appears twice in one round")
        for item in request.inputs:
            if not 0 <= item.steps <= request.speculative_num_steps:
                raise RoundError(
                    f"inputs[{item.request_id}].speculative_num_steps {item.steps} must be in "
                    f"[0, {request.speculative_num_steps}] (the round's; 0: the round's)"
                )
            if not item.appended:
                raise RoundError(f"inputs[{item.request_id}].appended_token_ids is empty")
            bad = [t for t in item.appended if not 0 <= t < self.vocab_size]
            if bad:
                raise RoundError(
                    f"inputs[{item.request_id}].appended_token_ids: {bad[0]} outside the vocabulary"
                )

    def _with_room(
        self, keyed: list[DraftInput], round_id: int, stream_id: str
    ) -> tuple[list[DraftInput], dict[str, str]]:
        """The (keyed) requests this cache can hold, and why each other one was refused (keyed
        request id → reason). A refused request gets no tree: the target decodes it plainly
        and re-sends its tokens later, so one request over the cache's length, or more requests
        than slots, never costs the others their drafts. A target (all its streams) holds at
        most `max_target_requests` slots, so one peer cannot take them all."""
        cfg = self.config
        cache = self.drafter.cache  # built to the config's cache_len
        free = cache.free_slots
        room = cfg.max_target_requests  # counted only where it bounds anything
        target = stream_target(stream_id)
        if room < cfg.max_requests:
            room -= sum(1 for key in self.drafter.requests if key.startswith(f"{target}#"))
        kept, refused = [], {}
        for item in keyed:
            entry = self.drafter.requests.get(item.request_id)
            length = cache.lengths[entry.slot] if entry else 0
            need = length + len(item.appended) + self.headroom
            if entry is None and item.continues:
                reason = (
                    "FAILED_PRECONDITION: continues a request this draft does not hold (its "
                    "hand-off was refused)"
                )
            elif need > cache.max_len:
                reason = f"OUT_OF_RANGE: {need} positions exceed the draft cache's {cache.max_len}"
            elif entry is None and free == 0:
                reason = f"RESOURCE_EXHAUSTED: all max_requests {cfg.max_requests} draft slots held"
            elif entry is None and room <= 0:
                reason = (
                    f"RESOURCE_EXHAUSTED: target {target} holds max_target_requests "
                    f"{cfg.max_target_requests} draft slots"
                )
            else:
                if entry is None:
                    free, room = free - 1, room - 1
                kept.append(item)
                continue
            self.round.release(item.request_id)
            refused[item.request_id] = reason
            if (left_out := self.repeats.due(("not drafted", target))) is not None:
                log.warning(
                    "request not drafted",
                    round_id=round_id,
                    request=item.request_id.removeprefix(f"{stream_id}/"),
                    reason=reason,
                    left_out=left_out,
                )
        return kept, refused

    def usage(self) -> dict[str, int]:
        """Draft slots held per target (requests keyed under its streams). Read from the event
        loop while a round may run: `list` copies the keys in one step under the GIL."""
        held: dict[str, int] = {}
        for key in list(self.drafter.requests):
            target = stream_target(key.partition("/")[0])
            held[target] = held.get(target, 0) + 1
        return held


def stream_target(stream_id: str) -> str:
    """The target a stream id names: `host:50051#3` → `host:50051` (targets never hold '#')."""
    return stream_id.rpartition("#")[0]
