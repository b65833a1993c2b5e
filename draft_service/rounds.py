"""The draft rounds: decode a RoundRequest, extend + draft at its tier, encode the trees.

Request ids are namespaced per Speculate stream, so two targets (or a reconnecting one) never
share draft state; a stream's requests are freed when it ends.
"""

from __future__ import annotations

import time

import torch

from specpair.config import DraftConfig
from specpair.logging import get_logger
from specpair.models.loading import CheckpointError, eagle_layout
from specpair.proto.v1 import common_pb2, draft_pb2
from specpair.runtime.build import build_drafter
from specpair.runtime.draft import Drafter, DraftInput
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.state import SpecRuntimeState, build_states, gpu_ms
from specpair.wire import draft_input_from_proto, tree_into

log = get_logger(__name__)
MAX_ERROR_CHARS = 500  # an error names the field; it never echoes a whole message back


class RoundError(ValueError):
    """A round the draft cannot serve; sent back in SpeculateResponse.error."""


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
        self.states: dict[int, SpecRuntimeState] = build_states(
            config.candidate_steps, [self.drafter]
        )

    @property
    def active_requests(self) -> int:
        return len(self.drafter.requests)

    def release_stream(self, stream_id: str) -> None:
        prefix = f"{stream_id}/"
        for key in [k for k in self.drafter.requests if k.startswith(prefix)]:
            self.drafter.release(key)

    def run(
        self, stream_id: str, request: draft_pb2.SpeculateRequest
    ) -> draft_pb2.SpeculateResponse:
        """One round; errors in the request come back in `error`, never as an exception."""
        t0 = time.perf_counter()
        for rid in request.released_request_ids:
            self.drafter.release(f"{stream_id}/{rid}")
        response = draft_pb2.SpeculateResponse(round_id=request.round_id)
        if not request.inputs:
            return response
        try:
            state = self._state(request.speculative_num_steps)
            self._check_ids(request)
            decoded = [(msg.request_id, self._decode(stream_id, msg)) for msg in request.inputs]
            drafted = self._with_room(decoded, request.round_id)
            trees = self.drafter.round([item for _, item in drafted], state) if drafted else []
        except Exception as exc:
            # Bad input (RoundError, ValueError), no room (CacheFullError) or a bug: the target
            # decodes this round plainly and re-sends these requests' full tokens, so their
            # state here is dropped either way, and the stream and its other requests go on.
            for msg in request.inputs:
                self.drafter.release(f"{stream_id}/{msg.request_id}")
            if isinstance(exc, ValueError | CacheFullError):
                log.warning("round rejected", round_id=request.round_id, error=str(exc))
            else:
                log.exception("round failed", round_id=request.round_id)
            response.error = str(exc)[:MAX_ERROR_CHARS] or type(exc).__name__
            return response
        for (rid, _), tree in zip(drafted, trees, strict=True):
            tree_into(response.trees.add(), rid, tree)
        total = 1e3 * (time.perf_counter() - t0)
        response.timings.CopyFrom(
            common_pb2.StageTimings(
                draft_ms=total, total_ms=total, draft_gpu_ms=gpu_ms(self.drafter)
            )
        )
        return response

    @property
    def plans_ahead(self) -> bool:
        """Whether `prepare` does anything: the drafter runs CUDA graphs."""
        return self.drafter.graphs is not None

    def prepare(self, stream_id: str, request: draft_pb2.SpeculateRequest) -> None:
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

    def _check_ids(self, request: draft_pb2.SpeculateRequest) -> None:
        ids = [msg.request_id for msg in request.inputs]
        if len(set(ids)) != len(ids):
            raise RoundError("inputs: a request_id appears twice in one round")

    def _with_room(
        self, decoded: list[tuple[str, DraftInput]], round_id: int
    ) -> list[tuple[str, DraftInput]]:
        """The requests this cache can hold; the rest get no tree (the target then decodes
        them plainly and re-sends their tokens later), so one request over the cache's length,
        or more requests than slots, never costs the others their drafts."""
        free = self.drafter.cache.free_slots
        kept = []
        for rid, item in decoded:
            entry = self.drafter.requests.get(item.request_id)
            length = self.drafter.cache.lengths[entry.slot] if entry else 0
            need = length + len(item.appended) + max(self.states)
            if need > self.config.cache_len:
                reason = f"{need} positions exceed the draft cache's {self.config.cache_len}"
            elif entry is None and free == 0:
                reason = "no free draft slot"
            else:
                if entry is None:
                    free -= 1
                kept.append((rid, item))
                continue
            self.drafter.release(item.request_id)
            log.warning("request not drafted", round_id=round_id, request=rid, reason=reason)
        return kept

    def _decode(self, stream_id: str, msg: draft_pb2.DraftInput) -> DraftInput:
        try:
            item = draft_input_from_proto(msg)
        except ValueError as exc:
            field = str(exc)
            if not field.startswith("inputs["):  # sampling_from_proto names only its field
                field = f"inputs[{msg.request_id}].sampling.{field}"
            raise RoundError(field) from None
        if not item.appended:
            raise RoundError(f"inputs[{msg.request_id}].appended_token_ids is empty")
        bad = [t for t in item.appended if not 0 <= t < self.vocab_size]
        if bad:
            raise RoundError(
                f"inputs[{msg.request_id}].appended_token_ids: {bad[0]} outside the vocabulary"
            )
        key = f"{stream_id}/{msg.request_id}"
        return DraftInput(key, item.appended, item.sampling, item.features)
