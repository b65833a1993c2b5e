"""EAGLE features by reference: a buffer the target writes and a draft on the same host maps
(`FeatureRing`, the target's; `RingView`, the draft's), so a round's features cross as a span
of rows, not as bytes through the host and gRPC.

A joining request's hand-off carries its prompt's features (all of them with `--draft-window
0`): at 64 clients on an H200 (grown 8B + EAGLE-3, 12 288 values a row) that was ~2 prompts ×
~800 rows × 24 KiB a round, 39 MB as bfloat16 bytes; in process a 64-prompt × 800-row
hand-off's answer took 784.9 ms as bytes, 96.6 through the ring (`bench/RESULTS.md`, "Features
by reference"). Through the ring it is one device copy on each side.

Memory: on a GPU a CUDA IPC handle of the buffer (the draft must see the same GPU); on the CPU
a memfd that the draft opens as /proc/PID/fd/N. Row 0 holds a random token: the draft answers
the probe with what it read there, and the target uses the ring only when that is its own, so a
draft that mapped something else (another host, another GPU) falls back to bytes.

Regions are a FIFO (`RingSpace`): a message's rows are written at the head, and freed when its
answer comes back (answers come in order). The draft copies a message's rows out before it
answers (`RingView.take`), so a freed region is never read again.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpair.logging import get_logger

log = get_logger(__name__)
TOKEN_BYTES = 16
MEMFD_NAME = "specpair-features"


@dataclass(frozen=True, slots=True)
class RingHandle:
    """What a draft needs to map a ring: its shape and dtype, and where its memory is (a
    path on the CPU; torch's `_share_cuda_()` tuple and the GPU's UUID on a GPU)."""

    rows: int  # data rows, after the token row
    width: int
    dtype: torch.dtype
    path: str = ""
    device_uuid: str = ""
    cuda: tuple[object, ...] = ()  # _share_cuda_()[1:]: handle, sizes, offsets, ref counter, event


class RingSpace:
    """Rows of a ring handed out in FIFO regions, each tagged with the message (`seq`) that
    carries it; `release(seq)` frees every region up to that message's.

    E.g. 10 rows: alloc 6 (seq 1) → 0; alloc 3 (seq 2) → 6; release(1); alloc 5 (seq 3) → 0
    (wraps: rows 9… hold 1, too few); alloc 2 (seq 4) → None (rows 5 and 9 free, apart)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._live: deque[tuple[int, int, int]] = deque()  # (seq, start, end), oldest first

    def room(self) -> int:
        """The most rows one region could take now."""
        if not self._live:
            return self.rows
        first, last = self._live[0][1], self._live[-1][2]
        if last > first:  # live [first, last): free at the end, then from 0
            return max(self.rows - last, first)
        return first - last  # wrapped: live [first, rows) ∪ [0, last)

    def alloc(self, seq: int, n: int) -> int | None:
        """The first row of a region of `n` rows for message `seq`, or None if none fits."""
        if n < 1 or n > self.room():
            return None
        if not self._live:
            start = 0
        else:
            first, last = self._live[0][1], self._live[-1][2]
            start = last if (last <= first or self.rows - last >= n) else 0
        self._live.append((seq, start, start + n))
        return start

    def release(self, seq: int) -> None:
        while self._live and self._live[0][0] <= seq:
            self._live.popleft()

    def reset(self) -> None:
        self._live.clear()


class FeatureRing:
    """The target's ring: [1 + rows, width] of `dtype` on `device`, row 0 its token."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        if rows < 1 or width * dtype.itemsize < TOKEN_BYTES:
            raise ValueError(f"a feature ring needs rows >= 1 and rows of {TOKEN_BYTES}+ bytes")
        if device.type == "cuda" and device.index is None:  # rows say cuda:N, never cuda
            device = torch.device("cuda", torch.cuda.current_device())
        self.width, self.dtype, self.device = width, dtype, device
        self.space = RingSpace(rows)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._path = ""  # the memfd's, on the CPU
        if device.type == "cuda":
            self.buf = torch.empty((rows + 1, width), dtype=dtype, device=device)
        else:
            # open while the process lives: each new stream's draft opens it anew
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            os.ftruncate(fd, (rows + 1) * width * dtype.itemsize)
            self._path = f"/proc/{os.getpid()}/fd/{fd}"
            flat = torch.from_file(self._path, shared=True, size=(rows + 1) * width, dtype=dtype)
            self.buf = flat.view(rows + 1, width)
        token = torch.frombuffer(bytearray(self.token), dtype=torch.uint8)
        self.buf[0].view(torch.uint8)[:TOKEN_BYTES].copy_(token)
        self._synchronize()
        self.handle = self._handle()

    @classmethod
    def of_bytes(
        cls, size_bytes: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> FeatureRing:
        """A ring of about `size_bytes` (its rows: what fits)."""
        return cls(max(size_bytes // (width * dtype.itemsize) - 1, 1), width, dtype, device)

    def _handle(self) -> RingHandle:
        rows, width, dtype = self.space.rows, self.width, self.dtype
        if self._path:
            return RingHandle(rows, width, dtype, path=self._path)
        shared = self.buf.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return RingHandle(rows, width, dtype, device_uuid=uuid, cuda=tuple(shared[1:]))

    def put(self, seq: int, rows: Sequence[Tensor | None]) -> list[int | None]:
        """Writes the longest run of `rows` (each [n, width] of this ring's dtype and device,
        or None) that fits as one region of message `seq`; the start of each one written (a
        data row), None for the others (sent as bytes). Written and complete on return."""
        starts: list[int | None] = [None] * len(rows)
        room, total, taken = self.space.room(), 0, []
        for i, r in enumerate(rows):
            if r is None or r.shape[0] == 0:
                continue
            if r.dim() != 2 or r.shape[1] != self.width or r.dtype != self.dtype:
                continue  # another shape or dtype than the ring's: as bytes
            if r.device != self.device or total + r.shape[0] > room:
                continue
            starts[i] = total
            taken.append(r)
            total += r.shape[0]
        if not taken:
            return starts
        start = self.space.alloc(seq, total)
        assert start is not None  # total <= room
        torch.cat(taken, out=self.buf[1 + start : 1 + start + total])
        self._synchronize()  # the draft reads it from another process: complete before sending
        return [None if s is None else start + s for s in starts]

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def release(self, seq: int) -> None:
        self.space.release(seq)

    def reset(self) -> None:
        """A new stream: every region is free (the old stream's draft state is gone)."""
        self.space.reset()


class RingView:
    """The draft's side of a `FeatureRing`: mapped from its handle; raises ValueError (or
    RuntimeError from the driver) when it cannot be."""

    @classmethod
    def of(cls, ring: FeatureRing) -> RingView:
        """The view of a ring of this process (a GPU allocation is not mapped by its own
        process): its buffer itself. For measuring a draft beside its target in process."""
        view = cls.__new__(cls)
        view.rows, view.width, view.dtype = ring.space.rows, ring.width, ring.dtype
        view.buf, view.device, view.token = ring.buf, ring.buf.device, ring.token
        return view

    def __init__(self, handle: RingHandle, device: torch.device) -> None:
        self.rows, self.width, self.dtype = handle.rows, handle.width, handle.dtype
        if handle.rows < 1 or handle.width < 1:
            raise ValueError("feature_ring: rows and width must be positive")
        elements = (handle.rows + 1) * handle.width
        if handle.path:
            if device.type != "cpu":
                raise ValueError("feature_ring.path: host memory, and this draft runs on a GPU")
            # Only a target's ring, never a file the peer names: the draft would answer the
            # probe with its first bytes.
            if not os.readlink(handle.path).startswith(f"/memfd:{MEMFD_NAME}"):
                raise ValueError("feature_ring.path: not a feature ring's memfd")
            size = os.stat(handle.path).st_size
            if size != elements * handle.dtype.itemsize:
                raise ValueError(f"feature_ring.path: {size} bytes, not the ring's")
            flat = torch.from_file(handle.path, shared=True, size=elements, dtype=handle.dtype)
        else:
            flat = _open_cuda(handle, device, elements)
        self.buf = flat.view(handle.rows + 1, handle.width)
        self.device = self.buf.device
        self.token = bytes(self.buf[0].view(torch.uint8)[:TOKEN_BYTES].cpu().tolist())

    def take(self, spans: Sequence[tuple[int, int]], fields: Sequence[str]) -> list[Tensor]:
        """Copies of the rows of each (start, rows) span, [rows, width] each, made in one copy
        and complete on return (the target may reuse the region once this round is answered).
        Raises ValueError naming the field (`fields[i]`) of a span outside the ring."""
        for (start, n), field in zip(spans, fields, strict=True):
            if n < 1 or start + n > self.rows:
                raise ValueError(
                    f"{field}: rows [{start}, {start + n}) outside the feature ring's "
                    f"{self.rows} (or empty)"
                )
        if not spans:
            return []
        lo, hi = min(s for s, _ in spans), max(s + n for s, n in spans)
        block = self.buf[1 + lo : 1 + hi].clone()
        if block.is_cuda:
            torch.cuda.current_stream(block.device).synchronize()
        return [block[s - lo : s - lo + n] for s, n in spans]


def _open_cuda(handle: RingHandle, device: torch.device, elements: int) -> Tensor:
    if device.type != "cuda":
        raise ValueError("feature_ring.cuda: GPU memory, and this draft runs on the CPU")
    index = next(
        (
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == handle.device_uuid
        ),
        None,
    )
    if index is None:
        raise ValueError(f"feature_ring.cuda: GPU {handle.device_uuid} is not visible here")
    if index != (device.index or 0):
        raise ValueError(f"feature_ring.cuda: the ring is on cuda:{index}, the draft on {device}")
    storage = torch.UntypedStorage._new_shared_cuda(index, *handle.cuda)  # type: ignore[attr-defined]
    if storage.nbytes() < elements * handle.dtype.itemsize:
        raise ValueError(f"feature_ring.cuda: {storage.nbytes()} bytes, fewer than the ring's")
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=handle.dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, (elements,), (1,))  # as torch's own IPC does
