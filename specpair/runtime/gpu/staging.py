"""Host-to-device copies into a CUDA graph's static buffers, through pinned twins."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from specpair.runtime.feature_rows import FeatureRows, Fp8Rows, place_features
from specpair.runtime.layout import place_rows


class Staging:
    """Host-to-device copies into static buffers through pinned twins, one per buffer.

    A copy from pageable memory first waits for all work queued on the stream, so the host
    could not prepare a graph's inputs while the previous graph ran; from a pinned twin the
    copy is asynchronous. A twin is rewritten only in a later call, after that call's caller
    has synchronized on the previous outputs (every stage ends reading its results).

    Copies made `deferred` (plans made ahead, `prepare`) wait in `pending` until the next
    replay flushes them: a service plans while its peer computes, and on a shared GPU a copy
    queued in one process's context then would preempt the peer's kernels (time-slicing
    between contexts slows the peer's graphs: bench/RESULTS.md).
    """

    def __init__(self) -> None:
        self.twins: dict[int, tuple[Tensor, Tensor]] = {}  # id(buffer) → (buffer, twin)
        self.pending: list[tuple[Tensor, Tensor]] = []  # (static buffer, its twin)
        self.defer = False

    def copy(self, dst: Tensor, src: Tensor) -> None:
        twin = self._twin(dst)
        twin.copy_(src)
        self._queue(dst, twin)

    def copy_rows(self, dst: Tensor, rows: Sequence[FeatureRows]) -> None:
        """rows[b] [n_b, ...] into dst[b, :n_b], each written once, straight into the twin.
        The rest of dst keeps stale (finite) values: only a graph's padding reads them, and
        padding is invisible to real rows (the buffers start as zeros). E.g. EAGLE-3 features
        at batch 8, 24 KB a row (bf16, 3H = 12 288): no zero-filled [B, T, 3H] staging copy and
        no second pad into the graph's shape.

        Float8 rows skip the twin: their bytes cross and are dequantized into dst on the
        device (`place_features`), queued now, not deferred, ahead of the replay that reads
        them."""
        plain = [r for r in rows if not isinstance(r, Fp8Rows)]
        if len(plain) < len(rows):
            place_features(dst, rows)
            return
        twin = place_rows(self._twin(dst), plain)
        self._queue(dst[: len(rows)], twin[: len(rows)])  # the bucket's padding rows stay

    def _twin(self, dst: Tensor) -> Tensor:
        entry = self.twins.get(id(dst))
        if entry is None:  # the entry holds the buffer too: its id is never reused meanwhile
            # zeros, not empty: padding a graph reads before any rows were written is finite
            twin = torch.zeros(dst.shape, dtype=dst.dtype, pin_memory=True)
            entry = self.twins[id(dst)] = (dst, twin)
        return entry[1]

    def _queue(self, dst: Tensor, twin: Tensor) -> None:
        if self.defer:
            self.pending.append((dst, twin))
        else:
            dst.copy_(twin, non_blocking=True)

    def flush(self) -> None:
        """Queues the deferred copies (a twin holds its latest values: a later plan of the
        same buffer rewrote it, so a stale entry copies what is current)."""
        for dst, twin in self.pending:
            dst.copy_(twin, non_blocking=True)
        self.pending.clear()

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
