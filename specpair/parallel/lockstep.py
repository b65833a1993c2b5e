"""The lockstep of a tensor-parallel target: rank 0 serves, ranks 1 … N-1 follow its steps.

Rank 0's `TargetWorker` runs unchanged over a `LeaderModel` and a `LockstepCache`. Every change
it makes to its cache (alloc, commit, free, truncate, bind) is recorded; every *collective*
step (a forward, the LM head, stop) goes to the followers as one `Step` carrying the changes
recorded since the last one, broadcast before rank 0 runs the step on its own shard. A
`Follower` replays the changes on its cache, in order, then runs the same step on its shard,
so its slots and page table are rank 0's step for step and the collectives inside each step
(`models/parallel.py`) pair up:

    rank 0: alloc → 3, bind(layout), forward(tokens) ── Step((Alloc(3), Bind(layout)), Forward)
    rank 1:                                              alloc → 3, bind(layout), forward(tokens)
    rank 0: logits(hidden [B, H]) ── Step((), Logits((B, H))), then hidden itself
    rank 0: commit(3, 0, keep) … recorded; it travels with the next step

Changes need no message of their own: nothing reads a follower's cache until its next forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from specpair.models.args import ModelArgs
from specpair.models.llama import Attend
from specpair.models.parallel import Shard, TensorParallelLlama
from specpair.runtime.gpu.attention import PagedAttend
from specpair.runtime.kv_cache import CacheFullError, KVCache
from specpair.runtime.layout import BatchLayout


class LockstepError(RuntimeError):
    """A follower's cache no longer mirrors rank 0's, or rank 0 broke the lockstep."""


# -- the changes to a cache, and the steps -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alloc:
    slot: int  # the slot rank 0 got: a follower must get the same


@dataclass(frozen=True, slots=True)
class Free:
    slot: int


@dataclass(frozen=True, slots=True)
class Commit:
    slot: int
    start: int
    keep: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Truncate:
    slot: int
    length: int


@dataclass(frozen=True, slots=True)
class Bind:
    layout: BatchLayout
    failed: bool = False  # rank 0's bind raised CacheFullError (after growing some slots)


CacheChange = Alloc | Free | Commit | Truncate | Bind


@dataclass(frozen=True, slots=True)
class Forward:
    tokens: Tensor  # [B, T] host
    positions: Tensor  # [B, T] host
    layers: tuple[int, ...]  # `forward_aux`'s feature layers


@dataclass(frozen=True, slots=True)
class Logits:
    shape: tuple[int, ...]  # the hidden states' [..., H]; the tensor follows the step
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Step:
    changes: tuple[CacheChange, ...]  # replayed first, in order
    op: Forward | Logits | Stop


def replay(cache: KVCache, change: CacheChange) -> PagedAttend | None:
    """Applies one of rank 0's changes to a follower's cache; a `Bind` returns its attend."""
    if isinstance(change, Alloc):
        if (slot := cache.alloc()) != change.slot:
            raise LockstepError(f"alloc gave slot {slot}, rank 0's gave {change.slot}")
    elif isinstance(change, Free):
        cache.free(change.slot)
    elif isinstance(change, Commit):
        cache.commit(change.slot, change.start, change.keep)
    elif isinstance(change, Truncate):
        cache.truncate(change.slot, change.length)
    else:
        try:
            attend = cache.bind(change.layout)
        except CacheFullError:
            if change.failed:
                return None  # as on rank 0, and the same slots grew before it raised
            raise LockstepError("a bind failed here that rank 0's did not") from None
        if change.failed:
            raise LockstepError("rank 0's bind failed, this rank's did not")
        return attend
    return None


# -- rank 0 ------------------------------------------------------------------------------------


class Lockstep:
    """Rank 0's side: the changes recorded since the last step, and the lock that keeps one
    step's collectives together (the compute thread runs steps; the event loop thread may free
    a slot meanwhile, which only records)."""

    def __init__(self) -> None:
        self.changes: list[CacheChange] = []
        self.bound: Attend | None = None  # the attend of the cache's last bind
        self.lock = threading.Lock()

    def record(self, change: CacheChange) -> None:
        with self.lock:
            self.changes.append(change)

    @contextmanager
    def step(self, op: Forward | Logits, payload: Tensor | None = None) -> Iterator[None]:
        """Broadcasts `op` (then `payload`) and holds the group while rank 0 runs it."""
        with self.lock:
            self._send(op, payload)
            yield

    def stop(self, timeout_s: float) -> bool:
        """Tells the followers to stop; False when a step held the group past `timeout_s`."""
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            self._send(Stop(), None)
        finally:
            self.lock.release()
        return True

    def _send(self, op: Forward | Logits | Stop, payload: Tensor | None) -> None:
        step = Step(tuple(self.changes), op)
        self.changes.clear()
        dist.broadcast_object_list([step], src=0)
        if payload is not None:
            dist.broadcast(payload, src=0)


class LeaderModel(TensorParallelLlama):
    """Rank 0's shard: each forward and LM head is first sent to the followers."""

    def __init__(self, args: ModelArgs, shard: Shard, lockstep: Lockstep) -> None:
        super().__init__(args, shard)
        self.lockstep = lockstep

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        return self.forward_aux(tokens, positions, attend, ())[0]

    def forward_aux(
        self, tokens: Tensor, positions: Tensor, attend: Attend, layers: tuple[int, ...]
    ) -> tuple[Tensor, Tensor]:
        if attend is not self.lockstep.bound:  # the followers attend over their last bind
            raise LockstepError("a forward over an attend the cache did not just bind")
        self.lockstep.bound = None
        with self.lockstep.step(Forward(tokens.cpu(), positions.cpu(), tuple(layers))):
            return super().forward_aux(tokens, positions, attend, layers)

    def logits(self, hidden: Tensor) -> Tensor:
        hidden = hidden.contiguous()
        with self.lockstep.step(Logits(tuple(hidden.shape), hidden.dtype), hidden):
            return super().logits(hidden)


class LockstepCache(KVCache):
    """Rank 0's cache: records every change for the followers.

    A change that raises leaves the cache as it was (alloc checks before it takes a slot), so
    only changes made are recorded; bind grows slot after slot and may raise part-way, so a
    failed bind is recorded too and the followers fail it alike."""

    def __init__(self, lockstep: Lockstep, **options: Any) -> None:
        super().__init__(**options)
        self.lockstep = lockstep

    def alloc(self) -> int:
        slot = super().alloc()
        self.lockstep.record(Alloc(slot))
        return slot

    def free(self, slot: int) -> None:
        super().free(slot)
        self.lockstep.record(Free(slot))

    def commit(self, slot: int, start: int, keep: Sequence[int]) -> int:
        keep = tuple(keep)
        length = super().commit(slot, start, keep)
        self.lockstep.record(Commit(slot, start, keep))
        return length

    def truncate(self, slot: int, length: int) -> None:
        super().truncate(slot, length)
        self.lockstep.record(Truncate(slot, length))

    def bind(self, layout: BatchLayout) -> PagedAttend:
        try:
            attend = super().bind(layout)
        except CacheFullError:
            self.lockstep.record(Bind(layout, failed=True))
            raise
        self.lockstep.record(Bind(layout))
        self.lockstep.bound = attend
        return attend

    def reserve(self, slot: int, length: int) -> None:
        raise NotImplementedError("a tensor-parallel target captures no CUDA graphs")


# -- ranks 1 … N-1 -----------------------------------------------------------------------------


class Follower:
    """A follower rank: replays rank 0's steps on its shard and cache until told to stop."""

    def __init__(self, model: TensorParallelLlama, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.attend: PagedAttend | None = None

    @torch.inference_mode()
    def run(self) -> None:
        while not isinstance(self.follow(), Stop):
            pass

    def follow(self) -> Forward | Logits | Stop:
        """Receives and runs one step; returns its op."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        step: Step = box[0]
        for change in step.changes:
            attend = replay(self.cache, change)
            if isinstance(change, Bind):
                self.attend = attend
        op, device = step.op, self.cache.device
        if isinstance(op, Forward):
            if self.attend is None:
                raise LockstepError("a forward without a bind before it")
            attend, self.attend = self.attend, None
            self.model.forward_aux(op.tokens.to(device), op.positions.to(device), attend, op.layers)
        elif isinstance(op, Logits):
            hidden = torch.empty(op.shape, dtype=op.dtype, device=device)
            dist.broadcast(hidden, src=0)
            self.model.logits(hidden)
        return op
