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

On GPUs the forwards run in CUDA graphs, which every rank captures together at start-up (one
`Build` step: the same builder, tiers and buckets on every rank, so the same graphs in the same
order, their all-reduces paired) and then replays together. Rank 0's graphs that hold
collectives report their plans and input loads as changes (`GraphPlan`, `GraphLoad`, in order
with the cache's), and each replay as a `Replay` step naming the graph:

    rank 0: prepare → plan(layout) ── Step((GraphPlan(17, 0, layout),), Apply())
    rank 1:                          the same plan on its graph 17, while rank 0 makes its own
    rank 0: load(positions); verify → load(tokens), replay(graph 17)
            ── Step((GraphLoad(17, "positions", …), GraphLoad(17, "tokens", …)), Replay(17))
    rank 1: the same loads, then its replay

So a round costs two step messages and no host round-trip per layer; the sums inside the
graphs go over peer memory or NCCL (`models/parallel.reduce_sum`). A step travels as bytes down
a pipe to each follower (`encode`: host tensors as numpy arrays), 0.2-0.4 ms of rank 0's host
time on an H200 pair, where a gloo broadcast of the pickled object took 1.6-2.9 ms a step on
an H100 pair and held the follower back by as much (`bench/tp_forward.py`).
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from specpair.models.args import ModelArgs
from specpair.models.llama import Attend
from specpair.models.parallel import Shard, TensorParallelLlama
from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.gpu.attention import PagedAttend
from specpair.runtime.kv_cache import CacheFullError, KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.shape import TreeShape

if TYPE_CHECKING:
    from specpair.runtime.gpu.capture import StageGraph
    from specpair.runtime.target.worker import TargetWorker


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


@dataclass(frozen=True, slots=True)
class GraphPlan:
    graph: int  # `StageGraph.index`
    attention: int  # its attention's place in `StageGraph.attention`
    layout: BatchLayout


@dataclass(frozen=True, slots=True)
class GraphLoad:
    graph: int
    name: str
    src: Tensor | tuple[FeatureRows, ...]  # a host tensor, or per-request rows (`load_rows`)


CacheChange = Alloc | Free | Commit | Truncate | Bind | GraphPlan | GraphLoad


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
class Build:
    """Capture the graphs: `StateBuilder(worker, buckets=buckets).build_all(tiers)`."""

    tiers: tuple[TreeShape, ...]
    buckets: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Replay:
    graph: int


@dataclass(frozen=True, slots=True)
class Apply:
    """Only the changes: a graph's plan, sent before rank 0 makes its own (`Lockstep.plan`),
    so that the followers plan while rank 0 does."""


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Op = Forward | Logits | Build | Replay | Apply | Stop


@dataclass(frozen=True, slots=True)
class Step:
    changes: tuple[CacheChange, ...]  # replayed first, in order
    op: Op


class _StepPickler(pickle.Pickler):
    """Pickles a host tensor as its raw bytes, dtype and shape: torch's own reduction writes
    each tensor through `torch.save` (tens of µs apiece, a step holds up to ten), and a numpy
    array's own reduction costs about a third more than its bytes (a plan step: 87 against
    125 µs to encode on a 2-core host)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor) and obj.device.type == "cpu" and obj.dtype != torch.bfloat16:
            array = obj.numpy()
            return _host_tensor, (array.tobytes(), array.dtype.str, array.shape)
        return NotImplemented


def _host_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> Tensor:
    # a copy: a tensor over the message's bytes would be read-only
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).reshape(shape).copy())


def encode(step: Step) -> bytes:
    buffer = io.BytesIO()
    _StepPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(step)
    return buffer.getvalue()


def decode(data: bytes) -> Step:
    step = pickle.loads(data)
    assert isinstance(step, Step)
    return step


def replay(
    cache: KVCache, change: CacheChange, graphs: Sequence[StageGraph] = ()
) -> PagedAttend | None:
    """Applies one of rank 0's changes to a follower's cache or `graphs`; a `Bind` returns
    its attend."""
    if isinstance(change, GraphPlan):
        graphs[change.graph].attention[change.attention].plan(change.layout)
    elif isinstance(change, GraphLoad):
        g = graphs[change.graph]
        if isinstance(change.src, tuple):
            g.load_rows(change.name, change.src)
        else:
            g.load(change.name, change.src)
    elif isinstance(change, Alloc):
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
        self.pipes: list[Connection] = []  # the steps' way to each follower
        self.muted = False  # inside a `Build`: every rank runs the same code, nothing is sent
        self.sent = 0  # steps sent
        self.send_s = 0.0  # host seconds spent sending them

    def record(self, change: CacheChange) -> None:
        if self.muted:
            return
        with self.lock:
            self.changes.append(change)

    @contextmanager
    def step(self, op: Forward | Logits, payload: Tensor | None = None) -> Iterator[None]:
        """Broadcasts `op` (then `payload`) and holds the group while rank 0 runs it."""
        with self.lock:
            self._send(op, payload)
            yield

    @contextmanager
    def building(self, op: Build) -> Iterator[None]:
        """Sends `op`, then runs the caller's build with the followers running theirs."""
        with self.lock:
            self._send(op, None)
            self.muted = True
            try:
                yield
            finally:
                self.muted = False

    # -- a `GraphMirror` (runtime/gpu/capture.py) for rank 0's collective graphs --------------

    def plan(self, graph: int, attention: int, layout: BatchLayout) -> None:
        """Sends the plan at once (an `Apply` step, with the changes recorded before it),
        before rank 0 makes its own: a follower's plan is its longest host work of a round
        (flashinfer's, over its pages), so it runs beside rank 0's instead of after it."""
        self.record(GraphPlan(graph, attention, layout))
        if not self.muted:
            with self.lock:
                self._send(Apply(), None)

    def load(self, graph: int, name: str, src: Tensor | Sequence[FeatureRows]) -> None:
        self.record(GraphLoad(graph, name, src if isinstance(src, Tensor) else tuple(src)))

    def replay(self, graph: int) -> None:
        if self.muted:
            return
        with self.lock:
            self._send(Replay(graph), None)

    def stop(self, timeout_s: float) -> bool:
        """Tells the followers to stop; False when a step held the group past `timeout_s`."""
        if not self.lock.acquire(timeout=timeout_s):
            return False
        try:
            self._send(Stop(), None)
        finally:
            self.lock.release()
        return True

    def _send(self, op: Op, payload: Tensor | None) -> None:
        t0 = time.perf_counter()
        data = encode(Step(tuple(self.changes), op))
        self.changes.clear()
        for pipe in self.pipes:
            pipe.send_bytes(data)
        self.sent += 1
        self.send_s += time.perf_counter() - t0
        if payload is not None:  # on the default group: NCCL for a GPU's tensor
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
        if self.lockstep.muted:  # a graph's capture: every rank captures the same
            return super().forward_aux(tokens, positions, attend, layers)
        if attend is not self.lockstep.bound:  # the followers attend over their last bind
            raise LockstepError("a forward over an attend the cache did not just bind")
        self.lockstep.bound = None
        with self.lockstep.step(Forward(tokens.cpu(), positions.cpu(), tuple(layers))):
            return super().forward_aux(tokens, positions, attend, layers)

    def logits(self, hidden: Tensor) -> Tensor:
        if self.lockstep.muted:
            return super().logits(hidden)
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
        # only a draft's graphs reserve (they grow pages on the device by themselves)
        raise NotImplementedError("a tensor-parallel target's graphs plan their pages")


# -- ranks 1 … N-1 -----------------------------------------------------------------------------


class Follower:
    """A follower rank: replays rank 0's steps on its shard and cache until told to stop.
    On a GPU it holds a `TargetWorker` over them, whose graphs a `Build` step captures."""

    def __init__(
        self, model: TensorParallelLlama, cache: KVCache, worker: TargetWorker | None = None
    ) -> None:
        self.model, self.cache, self.worker = model, cache, worker
        self.attend: PagedAttend | None = None
        self.graphs: list[StageGraph] = []
        self.pipe: Connection | None = None  # rank 0's steps arrive here (`Lockstep.pipes`)

    @torch.inference_mode()
    def run(self) -> None:
        while not isinstance(self.follow(), Stop):
            pass

    def follow(self) -> Op:
        """Receives and runs one step; returns its op."""
        assert self.pipe is not None, "a follower without its pipe"
        try:
            step = decode(self.pipe.recv_bytes())
        except EOFError:  # rank 0 is gone: nothing left to follow
            return Stop()
        device = self.cache.device
        if device.type == "cuda" and step.changes:
            # the staged copies of the last replay read pinned twins these loads rewrite
            torch.cuda.current_stream(device).synchronize()
        for change in step.changes:
            attend = replay(self.cache, change, self.graphs)
            if isinstance(change, Bind):
                self.attend = attend
        op = step.op
        if isinstance(op, Replay):
            self.graphs[op.graph].replay()
        elif isinstance(op, Forward):
            if self.attend is None:
                raise LockstepError("a forward without a bind before it")
            attend, self.attend = self.attend, None
            self.model.forward_aux(op.tokens.to(device), op.positions.to(device), attend, op.layers)
        elif isinstance(op, Logits):
            hidden = torch.empty(op.shape, dtype=op.dtype, device=device)
            dist.broadcast(hidden, src=0)
            self.model.logits(hidden)
        elif isinstance(op, Build):
            self.build(op)
        return op

    def build(self, op: Build) -> None:
        from specpair.runtime.build import StateBuilder

        if self.worker is None:
            raise LockstepError("a Build step on a rank without a worker (the CPU captures none)")
        builder = StateBuilder(self.worker, buckets=op.buckets)
        builder.build_all(op.tiers)
        if builder.target_graphs is not None:
            self.graphs = builder.target_graphs.graphs
