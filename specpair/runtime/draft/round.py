"""The draft's round, for the draft service and the in-process engine alike.

    answer   release what the target freed → go on from the pre-drafts it verified → extend
             each request with its appended tokens and draft its chain (`Drafter.draft`) →
             respond: a tree per request
    predraft pipelined: the second response, trees for the likeliest outcomes of those just
             sent (`pipeline.py`; without a `Pipeline` no pre-draft code runs)

Request ids may be namespaced by a `stream` (the draft service keys them per Round stream, so
two targets never share state: "s3/r7"); a response names them as the request did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.pipeline import Pipeline
from specpair.runtime.round import DraftInput, RoundRequest, RoundResponse
from specpair.runtime.state import SpecRuntimeState

# (keyed inputs, round id) → those the cache can hold, and why each other one gets no tree
Room = Callable[[list[DraftInput], int], tuple[list[DraftInput], dict[str, str]]]


class RoundError(ValueError):
    """A round the draft cannot serve; sent back in RoundResponse.error."""


class DraftRound:
    def __init__(self, drafter: Drafter, pipeline: Pipeline | None = None) -> None:
        self.drafter = drafter
        self.pipeline = pipeline  # None: this draft never pre-drafts

    def answer(
        self,
        request: RoundRequest,
        state: SpecRuntimeState | None,
        *,
        stream: str = "",
        room: Room | None = None,
    ) -> RoundResponse:
        """One round at `state`'s tier (None only for a round that just releases)."""
        pipeline, prefix = self.pipeline, f"{stream}/" if stream else ""
        if pipeline is not None:
            pipeline.forget(stream)
        for request_id in request.released_request_ids:
            self.release(prefix + request_id)
        if not request.inputs:
            return RoundResponse(request.round_id)
        assert state is not None, "a round with inputs needs its tier's state"
        keyed = [replace(i, request_id=prefix + i.request_id) for i in request.inputs]
        adopted: list[str] = []
        if pipeline is not None:  # the forks of `predrafted` inputs become their requests
            adopted = pipeline.begin(keyed, state)
        elif any(i.predrafted for i in keyed):
            raise RoundError("inputs: predrafted, but this draft does not pipeline (--pipeline)")
        fresh = [i for i in keyed if not i.predrafted]
        refused: dict[str, str] = {}
        if room is not None:
            fresh, refused = room(fresh, request.round_id)
        if not fresh:
            trees = []
        elif pipeline is not None and state.tier > 0 and request.predraft and state.is_chain:
            # a lookahead only where the target asked for pre-drafts: it costs a draft step
            trees = pipeline.draft(fresh, state)
        else:
            trees = self.drafter.draft(fresh, state)  # extend + draft
        if pipeline is not None and request.predraft and state.is_chain:  # chains only
            pipeline.promise(stream, keyed, state)
        n = len(prefix)
        return RoundResponse(
            request.round_id,
            {item.request_id[n:]: tree for item, tree in zip(fresh, trees, strict=True)},
            adopted=tuple(key[n:] for key in adopted),
            refused={key[n:]: why for key, why in refused.items()},
        )

    def predraft(self, round_id: int, stream: str = "") -> RoundResponse | None:
        """A pipelined round's second response: trees for the likeliest outcomes of the trees
        just sent; None when none were promised (no pipeline, or the round failed)."""
        ahead = self.pipeline.ahead(stream, round_id) if self.pipeline is not None else None
        if ahead is None:
            return None
        n = len(stream) + 1 if stream else 0
        return RoundResponse(round_id, predrafts={key[n:]: p for key, p in ahead.items()})

    def release(self, key: str) -> None:
        """Frees a request's state (`key`: namespaced), its pre-draft forks included."""
        (self.pipeline or self.drafter).release(key)

    def drop(self, request: RoundRequest, stream: str = "") -> None:
        """The round failed: the target decodes it plainly and re-sends these requests' whole
        history, so their state here goes (and any pre-draft owed)."""
        prefix = f"{stream}/" if stream else ""
        if self.pipeline is not None:
            self.pipeline.forget(stream)
        for request_id in (*request.released_request_ids, *(i.request_id for i in request.inputs)):
            self.release(prefix + request_id)

    def release_stream(self, stream: str) -> None:
        """Frees everything a stream's requests hold."""
        prefix = f"{stream}/"
        if self.pipeline is not None:
            self.pipeline.forget(stream)
            for key in [k for k in self.pipeline.drafted if k.startswith(prefix)]:
                self.pipeline.release(key)
        for key in [k for k in self.drafter.requests if k.startswith(prefix)]:
            self.drafter.release(key)
