"""How the target's round reaches its draft: the one seam between the two sides.

Two transports carry the same typed messages: `DraftPool` (`target_service/drafts/draft_pool.py`), a
long-lived gRPC Round stream to each draft replica (`DraftLink`), and `InProcessDraft`
(`runtime/engine.py`), a drafter in this process answering each round as the draft service
would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from specpair.runtime.round_messages import RoundRequest, RoundResponse
from specpair.runtime.target.worker import TargetSequence


class DraftTransport(Protocol):
    """`send` and `receive` never raise: a failed, late or broken round reads None."""

    @property
    def connected(self) -> bool: ...
    @property
    def features(self) -> bool: ...  # rounds carry the target's hidden states (an EAGLE draft)

    def epochs(self, seqs: Sequence[TargetSequence]) -> int | Mapping[str, int]:
        """The stream each request's round goes out on (one for all, or by request id); a new
        one has lost the request's state."""
        ...

    async def send(self, request: RoundRequest) -> int | None:
        """Writes one round; a number for `receive`, or None when it did not go out."""
        ...

    async def receive(self, round_id: int, sent: int) -> RoundResponse | None:
        """The round's answer."""
        ...

    async def receive_each(self, rounds: Sequence[tuple[int, int]]) -> list[RoundResponse | None]:
        """The answers to rounds (round id, `send`'s number) sent one after another, in
        order: a hand-off's, then the round sent behind it."""
        ...
