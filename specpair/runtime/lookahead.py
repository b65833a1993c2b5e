"""A drafted chain's lookahead: what it says about the round after it (`runtime/draft/pipeline.py`).

Drafting a chain of s tokens with a lookahead runs one step more (the whole chain's K/V written,
and the distribution after it) and keeps, at every depth, the draft's top-W tokens there and the
hidden state that gave them. From these a pipelined draft guesses the target's outcomes and
pre-drafts the next round for the likeliest ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LOOKAHEAD_TOP = 4  # the likeliest tokens a lookahead keeps per depth


@dataclass(frozen=True, slots=True)
class Lookahead:
    """What a drafted chain of s tokens says about the round after it. Row d (0..s) is the
    draft's distribution at chain position d — d < s: where chain[d] was drawn, d = s: after
    the whole chain — as its top-W tokens `ids`, their probabilities `p` ([s + 1, W], host),
    and the hidden state that gave it (`hidden` [s + 1, H], device): an EAGLE head's own
    prediction of the target feature there, which a pre-draft extends with."""

    ids: Tensor
    p: Tensor
    hidden: Tensor

    @staticmethod
    def stack(rows: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Lookahead:
        ids, p, hidden = zip(*rows, strict=True)
        return Lookahead(torch.stack(ids).cpu(), torch.stack(p).float().cpu(), torch.stack(hidden))

    def cut(self, depth: int) -> Lookahead:
        """The lookahead of the chain's first `depth` tokens: rows 0..depth. A graph drafts
        every request to the tier; a request of depth 2 at tier 4 keeps rows 0, 1, 2."""
        return Lookahead(self.ids[: depth + 1], self.p[: depth + 1], self.hidden[: depth + 1])


class TopRows:
    """Each request's lookahead rows as a step loop produces them, one per step it runs."""

    def __init__(self, requests: int, width: int) -> None:
        self.width = width
        self.rows: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in range(requests)]

    def add_step(self, requests: Sequence[int], logits: Tensor, hidden: Tensor) -> None:
        """A greedy step on the device: logits [R, V] and hidden [R, 1, H] of `requests`."""
        top = torch.softmax(logits, -1).topk(min(self.width, logits.shape[-1]))
        for i, b in enumerate(requests):
            self.rows[b].append((top.indices[i], top.values[i], hidden[i, -1]))

    def add(self, b: int, dist: Tensor, hidden: Tensor) -> None:
        """Request `b`'s step on the host: the distribution it drew from [V], hidden [H]."""
        top = dist.topk(min(self.width, dist.shape[-1]))
        self.rows[b].append((top.indices, top.values, hidden))

    def stacked(self) -> list[Lookahead]:
        return [Lookahead.stack(rows) for rows in self.rows]
