"""The draft's round, for the draft service and the in-process engine alike.

    answer   release what the target freed → go on from the pre-drafts it verified → extend
             each request with its appended tokens and draft its chain (`Drafter.draft`) →
             respond: a tree per request
    catch_up a request that joined rounds under way: its prompt extended after the response
             (the service calls it while the target verifies; every other call runs it first)
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
from specpair.runtime.layout import PAD_FREE
from specpair.runtime.round import DraftInput, RoundRequest, RoundResponse
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.tree import CandidateTree, chain

# (keyed inputs, round id) → those the cache can hold, and why each other one gets no tree
Room = Callable[[list[DraftInput], int], tuple[list[DraftInput], dict[str, str]]]
# A request new to the draft with more rows than this (a prompt, or a history re-sent whole),
# joining requests the draft already follows, is not drafted in that round: it answers the
# others without extending it first, and extends it in `catch_up`. At batch 8, sampled, each
# joining prompt held the whole round up (H100: rounds of 21 ms against a full batch's 15.7).
CATCH_UP_ROWS = PAD_FREE


class RoundError(ValueError):
    """A round the draft cannot serve; sent back in RoundResponse.error."""


class DraftRound:
    def __init__(
        self, drafter: Drafter, pipeline: Pipeline | None = None,
        catch_up_rows: int | None = CATCH_UP_ROWS,
    ) -> None:  # fmt: skip
        self.drafter = drafter
        self.pipeline = pipeline  # None: this draft never pre-drafts
        self.catch_up_rows = catch_up_rows  # None: every request extended in its round
        self.owed: list[DraftInput] = []  # (keyed) joining inputs `catch_up` extends
        self.lost: dict[str, str] = {}  # keyed id → why its catch-up failed (refused next)

    def answer(
        self,
        request: RoundRequest,
        state: SpecRuntimeState | None,
        *,
        stream: str = "",
        room: Room | None = None,
    ) -> RoundResponse:
        """One round at `state`'s tier (None only for a round that just releases)."""
        self.catch_up()
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
        lost = [i.request_id for i in fresh if i.request_id in self.lost]
        refused = {key: self.lost.pop(key) for key in lost}  # re-sent whole from here on
        fresh = [i for i in fresh if i.request_id not in refused]
        if room is not None:
            fresh, full = room(fresh, request.round_id)
            refused |= full
        owed = self._joining(fresh, state)
        fresh = [i for i in fresh if i not in owed]
        if not fresh:
            trees = []
        elif pipeline is not None and state.tier > 0 and request.predraft and state.is_chain:
            # a lookahead only where the target asked for pre-drafts: it costs a draft step
            trees = pipeline.draft(fresh, state)
        else:
            trees = self.drafter.draft(fresh, state)  # extend + draft
        if pipeline is not None and request.predraft and state.is_chain:  # chains only
            pipeline.promise(stream, keyed, state)
        self.owed = owed
        n = len(prefix)
        drafted: dict[str, CandidateTree] = {i.request_id[n:]: chain(()) for i in owed}
        return RoundResponse(
            request.round_id,
            drafted | {item.request_id[n:]: tree for item, tree in zip(fresh, trees, strict=True)},
            adopted=tuple(key[n:] for key in adopted),
            refused={key[n:]: why for key, why in refused.items()},
        )

    def _joining(self, fresh: list[DraftInput], state: SpecRuntimeState) -> list[DraftInput]:
        """The inputs `catch_up` extends after this round (`CATCH_UP_ROWS`): chains only, and
        never all of them (a round of newcomers alone waits for nobody)."""
        rows = self.catch_up_rows
        if rows is None or self.pipeline is not None or not state.is_chain or state.tier == 0:
            return []
        known = self.drafter.requests
        owed = [i for i in fresh if i.request_id not in known and len(i.appended) > rows]
        return owed if len(owed) < len(fresh) else []

    def catch_up(self) -> dict[str, str]:
        """Extends the requests the last round left owed; returns those whose extend failed
        (keyed id → why): their state is dropped and their next input refused, so the target
        re-sends them whole."""
        owed, self.owed = self.owed, []
        if not owed:
            return {}
        try:
            self.drafter.catch_up(owed)
        except Exception as exc:  # any failure costs only these requests
            why = f"INTERNAL: the draft's catch-up failed: {str(exc)[:200] or type(exc).__name__}"
            for item in owed:
                self.release(item.request_id)
                self.lost[item.request_id] = why
            return {item.request_id: why for item in owed}
        return {}

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
        self.owed = [i for i in self.owed if i.request_id != key]
        self.lost.pop(key, None)
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
        self.owed = [i for i in self.owed if not i.request_id.startswith(prefix)]
        self.lost = {k: why for k, why in self.lost.items() if not k.startswith(prefix)}
        if self.pipeline is not None:
            self.pipeline.forget(stream)
            for key in [k for k in self.pipeline.drafted if k.startswith(prefix)]:
                self.pipeline.release(key)
        for key in [k for k in self.drafter.requests if k.startswith(prefix)]:
            self.drafter.release(key)
