"""The draft service's side of the round: decode a RoundRequest, extend + draft at its tier,
answer a RoundResponse; pipelined (`RoundRequest.predraft`), then pre-draft the next round's
likeliest outcomes (`runtime/draft/pipeline.py`) and answer them in a second RoundResponse.

Request ids are namespaced per Round stream, whose id names the target that opened it
(`TARGET#n`, keys `TARGET#n/REQUEST`): two targets sending the same request id, or a
reconnecting one, never share draft state; a stream's requests are freed when it ends; and a
target's slots are counted over all its streams, at most `max_target_requests`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from specpair.config import DraftConfig, PipelineMode
from specpair.logging import get_logger
from specpair.models.loading import CheckpointError, eagle_layout
from specpair.proto.v1 import draft_pb2
from specpair.runtime.build import StateBuilder, build_drafter, feature_layers
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.pipeline import Pipeline
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.round import DraftInput, RoundRequest, RoundResponse, StageTimings
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.wire import request_from_proto, response_to_proto, timings_into

log = get_logger(__name__)
MAX_ERROR_CHARS = 500  # an error names the field; it never echoes a whole message back


class RoundError(ValueError):
    """A round the draft cannot serve; sent back in RoundResponse.error."""


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
        )
        self.vocab_size = self.drafter.args.vocab_size
        # What the target must send as features (GetServerInfo): () unless an EAGLE-3 head.
        self.feature_layers = (
            list(feature_layers(config.model_path, config.target_path))
            if layout is not None and config.target_path is not None
            else []
        )
        self.builder = StateBuilder(drafter=self.drafter, ahead=config.pipeline is PipelineMode.ON)
        self.states: dict[int, SpecRuntimeState] = self.builder.build_all(config.candidate_steps)
        self.pipeline = (
            Pipeline(self.drafter, config.pipeline_width)
            if config.pipeline is PipelineMode.ON
            else None
        )
        # stream id → the keyed round whose outcomes it pre-drafts next (`predraft`)
        self._ahead: dict[str, tuple[RoundRequest, SpecRuntimeState]] = {}

    @property
    def active_requests(self) -> int:
        return len(self.drafter.requests)

    def release(self, key: str) -> None:
        """Frees a request's state (`key`: namespaced), its pre-draft forks included."""
        if self.pipeline is not None:
            self.pipeline.release(key)
        else:
            self.drafter.release(key)

    def release_stream(self, stream_id: str) -> None:
        prefix = f"{stream_id}/"
        self._ahead.pop(stream_id, None)
        if self.pipeline is not None:
            for key in [k for k in self.pipeline.drafted if k.startswith(prefix)]:
                self.pipeline.release(key)
        for key in [k for k in self.drafter.requests if k.startswith(prefix)]:
            self.drafter.release(key)

    def run(self, stream_id: str, message: draft_pb2.RoundRequest) -> draft_pb2.RoundResponse:
        """One round off the wire; errors in it come back in `error`, never as an exception."""
        t0 = time.perf_counter()
        self._ahead.pop(stream_id, None)
        for rid in message.released_request_ids:
            self.release(f"{stream_id}/{rid}")
        if not message.inputs:
            return draft_pb2.RoundResponse(round_id=message.round_id)
        try:
            response = response_to_proto(self.draft(stream_id, request_from_proto(message)))
        except Exception as exc:
            # Bad input (RoundError, ValueError), no room (CacheFullError) or a bug: the target
            # decodes this round plainly and re-sends these requests' full tokens, so their
            # state here is dropped either way, and the stream and its other requests go on.
            for msg in message.inputs:
                self.release(f"{stream_id}/{msg.request_id}")
            if isinstance(exc, ValueError | CacheFullError):
                log.warning("round rejected", round_id=message.round_id, error=str(exc))
            else:
                log.exception("round failed", round_id=message.round_id)
            error = str(exc)[:MAX_ERROR_CHARS] or type(exc).__name__
            return draft_pb2.RoundResponse(round_id=message.round_id, error=error)
        total = 1e3 * (time.perf_counter() - t0)  # encoding the trees included
        timings = StageTimings(
            draft_ms=total,
            extend_ms=1e3 * self.drafter.last_times[0],
            total_ms=total,
            draft_gpu_ms=gpu_ms(self.drafter),
        )
        timings_into(response.timings, timings)
        return response

    def draft(self, stream_id: str, request: RoundRequest) -> RoundResponse:
        """Extends and drafts the requests this cache can hold, at the request's tier;
        pipelined, first goes on from the forks of `predrafted` inputs."""
        state = self._state(request.speculative_num_steps)
        self._check(request)
        keyed = [replace(i, request_id=f"{stream_id}/{i.request_id}") for i in request.inputs]
        pipeline = self.pipeline
        adopted: list[str] = []
        if pipeline is not None:
            adopted = pipeline.begin(keyed, state)
        elif any(i.predrafted for i in keyed):
            raise RoundError("inputs: predrafted, but this draft does not pipeline (--pipeline)")
        fresh = [(i, k) for i, k in zip(request.inputs, keyed, strict=True) if not k.predrafted]
        drafted, refused = self._with_room(fresh, request.round_id, stream_id)
        inputs = [key for _, key in drafted]
        if not inputs:
            trees = []
        elif pipeline is not None and state.tier > 0 and request.predraft:
            # a lookahead only where the target asked for pre-drafts: it costs a draft step
            trees = pipeline.draft(inputs, state)
        else:
            trees = self.drafter.draft(inputs, state)
        if pipeline is not None and request.predraft:
            self._ahead[stream_id] = (replace(request, inputs=tuple(keyed)), state)
        prefix = len(stream_id) + 1
        return RoundResponse(
            request.round_id,
            {item.request_id: tree for (item, _), tree in zip(drafted, trees, strict=True)},
            adopted=tuple(key[prefix:] for key in adopted),
            refused=refused,
        )

    def predraft(self, stream_id: str, round_id: int) -> draft_pb2.RoundResponse:
        """A pipelined round's second response: trees for the likeliest outcomes of the trees
        just sent (none when this draft does not pipeline or the round failed)."""
        ahead = self._ahead.pop(stream_id, None)
        if ahead is None or self.pipeline is None:
            return draft_pb2.RoundResponse(round_id=round_id)
        request, state = ahead
        t0 = time.perf_counter()
        try:
            predrafts = self.pipeline.predraft(request.inputs, state)
        except CacheFullError as exc:  # forks found no room: only these guesses are lost
            log.warning("pre-draft skipped", round_id=round_id, error=str(exc))
            predrafts = {}
        prefix = len(stream_id) + 1
        response = response_to_proto(
            RoundResponse(round_id, predrafts={k[prefix:]: p for k, p in predrafts.items()})
        )
        total = 1e3 * (time.perf_counter() - t0)
        timings_into(response.timings, StageTimings(draft_ms=total, total_ms=total))
        return response

    @property
    def plans_ahead(self) -> bool:
        """Whether `prepare` does anything: the drafter runs CUDA graphs."""
        return any(state.extend_stage().plans_ahead for state in self.states.values())

    def prepare(self, stream_id: str, request: draft_pb2.RoundRequest) -> None:
        """Plans the next round of this round's requests at its tier (see Drafter.prepare)."""
        state = self.states.get(request.speculative_num_steps)
        if state is not None:
            ids = [f"{stream_id}/{msg.request_id}" for msg in request.inputs]
            self.drafter.prepare(ids, state)

    def _state(self, tier: int) -> SpecRuntimeState:
        state = self.states.get(tier)
        if state is None:
            raise RoundError(
                f"speculative_num_steps {tier} is not a candidate tier {sorted(self.states)}"
            )
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
        self, decoded: list[tuple[DraftInput, DraftInput]], round_id: int, stream_id: str
    ) -> tuple[list[tuple[DraftInput, DraftInput]], dict[str, str]]:
        """The (sent, keyed) requests this cache can hold, and why each other one was refused
        (request id → reason). A refused request gets no tree: the target decodes it plainly
        and re-sends its tokens later, so one request over the cache's length, or more requests
        than slots, never costs the others their drafts. A target (all its streams) holds at
        most `max_target_requests` slots, so one peer cannot take them all."""
        cfg = self.config
        free = self.drafter.cache.free_slots
        room = cfg.max_target_requests  # counted only where it bounds anything
        target = stream_target(stream_id)
        if room < cfg.max_requests:
            prefix = f"{target}#"
            room -= sum(1 for key in self.drafter.requests if key.startswith(prefix))
        kept, refused = [], {}
        for sent, item in decoded:
            entry = self.drafter.requests.get(item.request_id)
            length = self.drafter.cache.lengths[entry.slot] if entry else 0
            need = length + len(item.appended) + max(self.states)
            if need > cfg.cache_len:
                reason = f"OUT_OF_RANGE: {need} positions exceed the draft cache's {cfg.cache_len}"
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
                kept.append((sent, item))
                continue
            self.release(item.request_id)
            refused[sent.request_id] = reason
            log.warning(
                "request not drafted", round_id=round_id, request=sent.request_id, reason=reason
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
