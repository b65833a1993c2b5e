"""EAGLE features the target keeps per request for the draft: the whole history
(`FeatureLog`, a remote draft may need to re-prefill from it) or only the rows since the last
round (`LastRows`, a drafter in this process never loses its state). `session.py` picks one."""

from __future__ import annotations

import torch
from torch import Tensor


class FeatureLog:
    """The target's hidden states of one request, a row per committed position (EAGLE features).

    Rows append into one buffer that grows by doubling, so a round reads the rows it sends as a
    view: the cost per round is the rows appended, not the context. The whole history stays
    because a reconnected draft re-prefills from it.
    """

    def __init__(self) -> None:
        self._rows: Tensor | None = None
        self.length = 0

    def append(self, rows: Tensor) -> None:
        end = self.length + len(rows)
        if self._rows is None or end > len(self._rows):
            grown = rows.new_empty((max(end, 2 * self.length, 64), rows.shape[-1]))
            if self._rows is not None:
                grown[: self.length] = self._rows[: self.length]
            self._rows = grown
        self._rows[self.length : end] = rows
        self.length = end

    def since(self, start: int) -> Tensor:
        """Rows from position `start` (clamped at 0) to the last committed one."""
        assert self._rows is not None, "no features recorded"
        return self._rows[max(start, 0) : self.length]


class LastRows:
    """`FeatureLog`'s interface for a drafter in this process: it never loses a request's
    state, so each round needs only the rows appended since the previous one, and they are
    passed on as they are instead of copied into a history (a copy per request per round).
    Rows no round has read yet (its tier was 0) are kept until one does."""

    def __init__(self) -> None:
        self._rows: Tensor | None = None
        self._first = 0  # the position of _rows[0]
        self._read = True  # `since` has returned _rows
        self.length = 0

    def append(self, rows: Tensor) -> None:
        if self._read or self._rows is None:
            self._rows, self._first = rows, self.length
        else:
            self._rows = torch.cat([self._rows, rows])
        self._read = False
        self.length += rows.shape[0]  # not len(): a Python call per request per round

    def since(self, start: int) -> Tensor:
        """The kept rows from position `start` (a window's start may lie past the first)."""
        assert self._rows is not None, "no features recorded"
        self._read = True
        if max(start, 0) < self._first:
            raise ValueError(
                f"features from position {start} asked, but only the last round's rows from "
                f"{self._first} are kept (a drafter in this process)"
            )
        return self._rows[max(start, 0) - self._first :]
