"""The target's side of the round protocol: what the draft has seen of each request.

`DraftSession` is the one place that decides what goes to the draft next and what comes back
is worth verifying. The target's round (`target_round.py`: the target service, the in-process
engine and the GPU benchmarks alike) drives it:

    session.add(seq, prefill_features)              # a prefilled request joins
    handoff = session.handoff(round_id, new_seqs)    # its prompt, ahead of its first round
    request = session.request(round_id, seqs, tier)  # RoundRequest: each one's new tokens
    drafts = session.drafts(request, response)       # checked trees, aligned with the batch
    ... verify + accept ...
    session.verified(seq, result.features)           # EAGLE features of the committed rows
    session.release(request_id)                      # it left: freed with the next request

Per request it counts the tokens (prompt + output) the draft holds. Sent tokens count once the
draft answers with a tree for them; no tree, a refused round or a new stream (epoch: a
reconnected draft lost everything) sets the count to 0, so the draft re-prefills from the
request's whole history (tokens, and features from the `FeatureLog`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from specpair.logging import Repeats, get_logger
from specpair.runtime.round_messages import DraftInput, RoundRequest, RoundResponse, StageTimings
from specpair.runtime.shape import MAX_TREE_NODES, TreeShape
from specpair.runtime.target.features import FeatureLog, LastRows
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE, CandidateTree, sparse_q_faults, validate_tree

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class DraftView:
    """What the draft holds of one request."""

    seq: TargetSequence
    features: FeatureLog | LastRows
    # tokens (prompt + output) the draft has been sent and processed, or passed over: with a
    # window the draft starts a request at its history's last `window` tokens, and the ones
    # before them count as seen without ever going out
    seen: int = 0
    epoch: int = -1  # the draft stream `seen` counts on
    # `seen` counts a hand-off whose answer is unread (`handed_ahead`): while `seen` holds, the
    # draft is asked to continue the request (`DraftInput.continues`), not to start it afresh
    ahead: bool = False


@dataclass(frozen=True, slots=True)
class Drafts:
    """A round's trees, aligned with its request's inputs; empty ones are decoded plainly."""

    trees: list[CandidateTree]
    timings: StageTimings  # the draft service's own (zero without an answer)
    speculative: bool  # False: the round got no drafts at all
    fallbacks: list[str] = field(default_factory=list)  # why speculation was lost, per case
    request_ids: tuple[str, ...] = ()  # whose each tree is (the request's inputs)

    def aligned(self, request_ids: Sequence[str]) -> list[CandidateTree]:
        """The trees of a batch, empty for a request that was not sent (its tier was 0)."""
        if tuple(request_ids) == self.request_ids:
            return self.trees
        by_id = dict(zip(self.request_ids, self.trees, strict=True))
        return [by_id.get(rid, EMPTY_TREE) for rid in request_ids]


class DraftSession:
    def __init__(
        self,
        vocab_size: int,
        *,
        in_process: bool = False,
        features: bool = True,
        max_tree_nodes: int = MAX_TREE_NODES,
        window: int = 0,
    ) -> None:
        # A draft service may be buggy or another build, and may lose every request's state
        # (a reconnect): its trees are checked and each request's features kept whole. A
        # drafter in this process (the engine, the benchmarks) is this code and never forgets:
        # both would cost its rounds for nothing. `features`: keep the target's hidden states
        # at all (a drafter in this process that reads none needs none).
        self.vocab_size = vocab_size
        self.in_process = in_process
        self.features = features
        self.max_tree_nodes = max_tree_nodes
        # A draft starting (or restarting) a request is sent only its history's last `window`
        # tokens, 0: all. Drafts attend with rope, which sees only distances, so a window
        # placed at positions 0.. drafts as it would at its true positions, over less context.
        # An EAGLE head's features carry some of the target's view of the rest, not all: on
        # 400-512-token prompts the shipped EAGLE-3 head accepts 2.18 a round at a window of 32
        # against 3.12 whole (128: 2.92; bench/RESULTS.md, "Draft window").
        self.window = window
        self.views: dict[str, DraftView] = {}
        self._released: list[str] = []
        # A draft that errs every round (or sends a bad tree for every request) is logged once
        # in a while, with how many were left out, not once a round.
        self.repeats = Repeats()

    def add(self, seq: TargetSequence, features: Tensor | None) -> None:
        """A prefilled request; `features`: its prompt's hidden states [P, H] (EAGLE) or None."""
        view = DraftView(seq, LastRows() if self.in_process else FeatureLog())
        if features is not None and self.features:
            view.features.append(features)
        self.views[seq.request_id] = view

    def verified(self, seq: TargetSequence, features: Tensor | None) -> None:
        """A verify committed rows of `seq`; `features` [n, H] are theirs (EAGLE) or None."""
        view = self.views.get(seq.request_id)
        if features is not None and view is not None and self.features:
            view.features.append(features)
            if self.window > 0 and isinstance(view.features, FeatureLog):
                view.features.trim(self._needed_from(view))

    def release(self, request_id: str) -> None:
        """The request left: the draft frees its state when the next request goes out."""
        self.views.pop(request_id, None)
        self._released.append(request_id)

    def no_stream(self) -> None:
        """No draft stream is open: it holds nothing, so there is nothing to release."""
        self._released.clear()

    def request(
        self,
        round_id: int,
        seqs: Sequence[TargetSequence],
        tier: int,
        *,
        epoch: int | Mapping[str, int] = 0,
        features: bool = False,
        steps: Sequence[int] | None = None,
        shape: TreeShape | None = None,
    ) -> RoundRequest:
        """The next round for `seqs` on the draft stream `epoch` (or each request's own, by id:
        a pool of draft replicas): per request the tokens the draft has not seen (and, with
        `features`, the hidden states that predicted them).
        `steps` (per request, at most `tier`): each one's own tier; one at 0 is not sent, and
        what it appends meanwhile goes out with its next round at a positive tier.
        `shape`: the round's tree shape, when it is one (`tier` is its steps).

        Worked example: prompt [5, 6, 7], output [8] (pending), nothing seen → appended
        (5, 6, 7, 8) and the prompt's 3 feature rows; the draft answers, seen = 4; verify
        accepts 2 drafts + bonus, output [8, 9, 4, 2] → next appended (9, 4, 2) with the 3
        feature rows from position 3 (those of 8, 9, 4, which predicted 9, 4, 2).
        """
        inputs = []
        for i, seq in enumerate(seqs):
            own = tier if steps is None else steps[i]
            if own == 0:
                continue
            own = 0 if own == tier else own  # 0 on the wire: the round's tier
            inputs.append(self._unseen(seq, epoch, features, own))
        return RoundRequest(round_id, tier, tuple(inputs), self._drain_released(), shape)

    def feed(
        self,
        round_id: int,
        seqs: Sequence[TargetSequence],
        *,
        epoch: int | Mapping[str, int] = 0,
        features: bool = False,
    ) -> RoundRequest:
        """A round at tier 0 for `seqs`: what `request` would send each (the draft only
        extends, and answers with empty chains), so that the next round at a positive tier
        appends one token a request. Worked example: seen 4 of prompt [5, 6, 7] + output
        [8, 9, 4, 2] → appended (9, 4, 2) with the rows of 8, 9, 4; the draft answers, seen = 7."""
        inputs = tuple(self._unseen(seq, epoch, features, 0) for seq in seqs)
        return RoundRequest(round_id, 0, inputs, self._drain_released())

    def _unseen(
        self,
        seq: TargetSequence,
        epoch: int | Mapping[str, int],
        features: bool,
        steps: int,
    ) -> DraftInput:
        """`seq`'s tokens the draft has not seen (with `features`, the rows that predicted
        them), on its stream `epoch`; `steps`: its own tier on the wire (0: the round's)."""
        view = self.views[seq.request_id]
        self._renew(view, epoch)
        # once `seen` fell to 0 (a refusal, a new stream) the draft starts the request afresh
        continues = view.ahead and view.seen > 0
        self._window(view, len(seq.prompt) + len(seq.output))
        seen, prompt = view.seen, len(seq.prompt)
        if seen >= prompt:
            appended = tuple(seq.output[seen - prompt :])
        else:
            appended = (*seq.prompt[seen:], *seq.output)
        rows = view.features.since(seen - 1) if features else None
        return DraftInput(seq.request_id, appended, seq.sampling, rows, steps, continues)

    def handoff(
        self,
        round_id: int,
        seqs: Sequence[TargetSequence],
        *,
        epoch: int | Mapping[str, int] = 0,
        features: bool = False,
    ) -> RoundRequest | None:
        """The prompts of `seqs` the draft has not seen, handed over ahead of their first round
        (a round at tier 0: the draft only extends, and answers with empty chains); None when
        there are none. The first output token stays for the first round, which then appends
        one token, as any later round does, instead of the whole prompt. Requests that left
        since the last request go with it, freed before the prompts are taken: a joiner takes
        the place of one that left after the round now out was sent, and a draft with as many
        slots as the target's batch would else find them all held and refuse it.

        Worked example: prompt [5, 6, 7], output [8] (pending), nothing seen → appended
        (5, 6, 7) with the 2 feature rows that predicted 6, 7; the draft answers, seen = 3; the
        first round appends (8,) with the row of 7. With a window of 2: appended (6, 7) with
        the rows of 5, 6 (seen = 1 passed over, then 3).
        """
        inputs = []
        for seq in seqs:
            view = self.views.get(seq.request_id)
            if view is None:
                continue
            self._renew(view, epoch)
            if view.seen or len(seq.prompt) < 2:
                continue
            self._window(view, len(seq.prompt))
            start, end = view.seen, len(seq.prompt)
            prompt = tuple(seq.prompt[start:])
            # the rows that predicted prompt[start:], less the first token's when start is 0
            rows = view.features.since(start - 1)[: end - max(start, 1)] if features else None
            inputs.append(DraftInput(seq.request_id, prompt, seq.sampling, rows))
        if not inputs:
            return None
        return RoundRequest(round_id, 0, tuple(inputs), self._drain_released())

    def handed_ahead(self, request: RoundRequest) -> None:
        """`request`, a hand-off (`handoff`) whose answer is read only after the next round has
        gone out behind it: its prompts count as seen now, so that round appends the first token
        of each, flagged `continues`. Its answer then goes to `drafts(..., ahead=True)`, which
        undoes the count of a prompt the draft refused. Worked example: prompt [5, 6, 7],
        output [8]: the hand-off appends (5, 6, 7), seen = 3 at once, the next round appends
        (8,) with `continues`; the draft refused the hand-off → seen = 0, and the round after
        appends (5, 6, 7, 8, …) again."""
        for item in request.inputs:
            if (view := self.views.get(item.request_id)) is not None:
                view.seen += len(item.appended)
                view.ahead = True

    def _drain_released(self) -> tuple[str, ...]:
        """The requests that left since the last request went out, handed to this one."""
        released = tuple(self._released)
        self._released.clear()
        return released

    def _needed_from(self, view: DraftView) -> int:
        """The first position whose feature row a later request may ask of `view`: the draft's
        next rows start at the row before its first unseen token (`seen - 1`, kept while a
        round is out, to be sent again if it fails), and a draft starting the request afresh
        (a reconnect, another replica) at its window's. With a window of 32 on a request of
        500 tokens the draft has seen 498 of: 467."""
        length = len(view.seq.prompt) + len(view.seq.output)
        restart = length - self.window - 1
        return restart if view.seen == 0 else min(view.seen - 1, restart)

    def _window(self, view: DraftView, length: int) -> None:
        """A request the draft holds nothing of, `length` tokens long, starts at its last
        `window` tokens: those before count as seen."""
        if view.seen == 0 and 0 < self.window < length:
            view.seen = length - self.window

    @staticmethod
    def _renew(view: DraftView, epoch: int | Mapping[str, int]) -> None:
        """Puts `view` on its draft stream `epoch` (or its own, by request id); a new stream
        holds nothing of the request: it is re-sent from scratch."""
        stream = epoch if isinstance(epoch, int) else epoch[view.seq.request_id]
        if view.epoch != stream:
            view.seen, view.epoch = 0, stream

    def releases(self, round_id: int) -> RoundRequest | None:
        """A request that only frees state (when no round follows), or None: nothing to free."""
        if not self._released:
            return None
        return RoundRequest(round_id, 0, (), self._drain_released())

    def drafts(
        self, request: RoundRequest, response: RoundResponse | None, *, ahead: bool = False
    ) -> Drafts:
        """The trees `response` brings for `request`'s inputs (None: the draft failed to
        answer). A tree that breaks the rules costs only its request's speculation. `ahead`:
        `request` was counted as seen when it went out (`handed_ahead`); only what the draft
        did not keep is undone."""
        empty = [EMPTY_TREE] * len(request.inputs)
        ids = tuple(item.request_id for item in request.inputs)
        if ahead:
            self._answered_ahead(request, lost=response is None)
        if response is None:
            return Drafts(empty, StageTimings(), False, ["draft_failed"], ids)
        if response.error:  # cut at the wire (`response_from_proto`)
            if (left_out := self.repeats.due("draft error")) is not None:
                log.warning(
                    "draft refused the round",
                    round_id=request.round_id,
                    error=response.error,
                    left_out=left_out,
                )
            for item in request.inputs:  # it dropped their state: re-send everything
                if (view := self.views.get(item.request_id)) is not None:
                    view.seen = 0
            return Drafts(empty, response.timings, False, ["draft_error"], ids)
        trees: list[CandidateTree] = []
        fallbacks: list[str] = []
        unchecked: list[int] = []  # trees whose sparse q is still to check
        for item in request.inputs:
            tree = response.trees.get(item.request_id)
            why = response.malformed.get(item.request_id)
            view = self.views.get(item.request_id)
            kept = tree is not None or why is not None  # no tree: the draft kept nothing
            if view is not None:  # `ahead`: `handed_ahead` counted the input when it went out
                counted = view.seen if ahead else view.seen + len(item.appended)
                view.seen = counted if kept else 0
            if item.request_id in response.refused:  # no room there (the reason names it)
                fallbacks.append("draft_refused")
            if tree is not None and not self.in_process:
                tier = item.steps or request.speculative_num_steps
                why = self.fault(tree, item, tier, request.shape is not None, sparse_q=False)
            if why is not None:
                self._malformed(item.request_id, why, fallbacks)
                tree = None
            elif tree is not None and not self.in_process:
                unchecked.append(len(trees))
            trees.append(EMPTY_TREE if tree is None else tree)
        # the sparse q of the round's trees at once (`fault` left them)
        faults = sparse_q_faults([trees[i] for i in unchecked], self.vocab_size)
        for i, why in zip(unchecked, faults, strict=True):
            if why is not None:
                self._malformed(ids[i], why, fallbacks)
                trees[i] = EMPTY_TREE
        return Drafts(trees, response.timings, True, fallbacks, ids)

    def _answered_ahead(self, request: RoundRequest, *, lost: bool) -> None:
        """A hand-off counted when it went out, answered: its requests are no longer ahead, and
        a `lost` one (no answer) sends its prompts whole again, as an error or a missing tree
        does (`drafts`, for any round)."""
        for item in request.inputs:
            if (view := self.views.get(item.request_id)) is not None:
                view.ahead = False
                if lost:
                    view.seen = 0

    def _malformed(self, request_id: str, why: str, fallbacks: list[str]) -> None:
        if (left_out := self.repeats.due("malformed tree")) is not None:
            log.warning(
                "malformed candidate tree", request_id=request_id, error=why, left_out=left_out
            )
        fallbacks.append("malformed_tree")

    def fault(
        self,
        tree: CandidateTree,
        item: DraftInput,
        tier: int,
        tree_round: bool = False,
        *,
        sparse_q: bool = True,
    ) -> str | None:
        """Why `tree` cannot be verified for `item` at `tier`, or None when it can (with
        `sparse_q` off, a sparse q is left to `sparse_q_faults`). A sampled chain carries the q
        it was drawn from; a tree round's trees carry none (they are accepted by the
        target-only rule, exact without q)."""
        try:
            validate_tree(
                tree,
                max_nodes=self.max_tree_nodes,
                max_depth=tier,
                vocab_size=self.vocab_size,
                sparse_q=sparse_q,
            )
        except ValueError as exc:  # MalformedTreeError, or a shape torch refuses
            return str(exc)
        if len(tree) and not item.sampling.greedy and tree.draft_probs is None and not tree_round:
            return "sampling round without draft_probs"
        return None
