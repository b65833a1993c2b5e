"""EAGLE features the target keeps per request for the draft: the history a remote draft may
need to re-prefill from (`FeatureLog`: all of it, or from its draft window on) or only the rows
since the last round (`LastRows`, a drafter in this process never loses its state).
`session.py` picks one."""

from __future__ import annotations

import torch
from torch import Tensor

FOLD_AT = 16  # chunks a log holds as views; past it the oldest is copied into its buffer
PINNED_READ_BYTES = 64 << 20  # `host_rows`: a read past it stays pageable


def host_rows(rows: Tensor) -> Tensor:
    """`rows` on the host. From a GPU, a read of up to `PINNED_READ_BYTES` lands in pinned
    memory from torch's caching host allocator: a DMA at full speed into blocks that were
    touched before, where `.cpu()` stages through the driver into fresh pageable pages (a
    verify's 64 × 5 rows of EAGLE-3 features are 7.9 MB a round). A larger read (a wave of
    prompts) stays pageable: the allocator keeps what it pins."""
    if not rows.is_cuda or rows.nbytes > PINNED_READ_BYTES:
        return rows.cpu()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    return host.copy_(rows)


class FeatureLog:
    """The target's hidden states of one request, a row per committed position (EAGLE features).

    A round's rows are kept as they arrive, views of the verify's one read-back (`kept_rows`):
    appending copies nothing, and the usual round reads exactly the rows the last one appended,
    a view again, so each row is copied once on its way out (into the message). Past `FOLD_AT`
    such chunks the oldest is copied into one buffer that grows by doubling, which lets go of
    the read-back it kept alive (the rest of a batch's rows). `trim` drops the rows no later
    read can ask for: with a draft window, those before the window and the draft's own.

    Positions: the buffer holds [start, start + owned), the chunks the rest up to `length`.
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None
        self._owned = 0  # rows of the buffer in use
        self._start = 0  # the position of the first row kept
        self._chunks: list[Tensor] = []
        self.length = 0

    def append(self, rows: Tensor) -> None:
        self._chunks.append(rows)
        self.length += rows.shape[0]
        if len(self._chunks) > FOLD_AT:  # one a round: a batch's logs never fold all at once
            self._fold(self._chunks.pop(0))

    def _fold(self, rows: Tensor) -> None:
        end = self._owned + len(rows)
        if self._buffer is None or end > len(self._buffer):
            grown = rows.new_empty((max(end, 2 * self._owned, 64), rows.shape[-1]))
            if self._buffer is not None:
                grown[: self._owned] = self._buffer[: self._owned]
            self._buffer = grown
        self._buffer[self._owned : end] = rows
        self._owned = end

    def since(self, start: int) -> Tensor:
        """Rows from position `start` (clamped at 0) to the last committed one: a view when
        they lie in one chunk (the usual round), else one copy."""
        assert self._chunks or self._buffer is not None, "no features recorded"
        start = max(start, 0)
        if start < self._start:
            raise ValueError(f"features from position {start} asked, trimmed before {self._start}")
        parts, end = [], self.length
        for chunk in reversed(self._chunks):
            begin = end - chunk.shape[0]
            parts.append(chunk[max(start - begin, 0) :])
            if begin <= start:
                break
            end = begin
        else:
            if self._buffer is not None and start < end:
                parts.append(self._buffer[start - self._start : self._owned])
        return parts[0] if len(parts) == 1 else torch.cat(parts[::-1])

    @property
    def first(self) -> int:
        """The position of the first row kept (0 until a `trim`)."""
        return self._start

    def trim(self, position: int) -> None:
        """Lets go of rows before `position` (whole chunks, the buffer once all of it lies
        before); the last chunk stays, so that a read at `length` still has a dtype and width."""
        if self._buffer is not None:
            if self._start + self._owned > position:
                return
            self._start += self._owned
            self._buffer, self._owned = None, 0
        while len(self._chunks) > 1 and self._start + self._chunks[0].shape[0] <= position:
            self._start += self._chunks.pop(0).shape[0]


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
