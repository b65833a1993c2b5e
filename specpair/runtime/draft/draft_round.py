"""The draft's round, for the draft service and the in-process engine alike.

    answer   release what the target freed → extend each request with its appended tokens and
             draft its chain (`Drafter.draft`) → respond: a tree per request

Request ids may be namespaced by a `stream` (the draft service keys them per Round stream, so
two targets never share state: "s3/r7"); a response names them as the request did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.round_messages import DraftInput, RoundRequest, RoundResponse
from specpair.runtime.state import SpecRuntimeState

# (keyed inputs, round id) → those the cache can hold, and why each other one gets no tree
Room = Callable[[list[DraftInput], int], tuple[list[DraftInput], dict[str, str]]]


class RoundError(ValueError):
    """A round the draft cannot serve; sent back in RoundResponse.error."""


class DraftRound:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def answer(
        self,
        request: RoundRequest,
        state: SpecRuntimeState | None,
        *,
        stream: str = "",
        room: Room | None = None,
    ) -> RoundResponse:
        """One round at `state`'s tier (None only for a round that just releases)."""
        prefix = f"{stream}/" if stream else ""
        for request_id in request.released_request_ids:
            self.release(prefix + request_id)
        if not request.inputs:
            return RoundResponse(request.round_id)
        assert state is not None, "a round with inputs needs its tier's state"
        fresh = [replace(i, request_id=prefix + i.request_id) for i in request.inputs]
        refused: dict[str, str] = {}
        if room is not None:
            fresh, refused = room(fresh, request.round_id)
        trees = self.drafter.draft(fresh, state) if fresh else []  # extend + draft
        n = len(prefix)
        return RoundResponse(
            request.round_id,
            {item.request_id[n:]: tree for item, tree in zip(fresh, trees, strict=True)},
            refused={key[n:]: why for key, why in refused.items()},
        )

    def release(self, key: str) -> None:
        """Frees a request's state (`key`: namespaced)."""
        self.drafter.release(key)

    def drop(self, request: RoundRequest, stream: str = "") -> None:
        """The round failed: the target decodes it plainly and re-sends these requests' whole
        history, so their state here goes."""
        prefix = f"{stream}/" if stream else ""
        for request_id in (*request.released_request_ids, *(i.request_id for i in request.inputs)):
            self.release(prefix + request_id)

    def release_stream(self, stream: str) -> None:
        """Frees everything a stream's requests hold."""
        prefix = f"{stream}/"
        for key in [k for k in self.drafter.requests if k.startswith(prefix)]:
            self.drafter.release(key)
