"""Capturing a stage's CUDA graphs: buckets, padding, static attention, one pool, timing.

Each graph runs over static input/output buffers and an attention whose metadata lives in
static buffers (the Triton tree attention of `tree_attention.py`, or flashinfer in CUDA-graph
mode with `graph_attention="flashinfer"`); before a replay the host *plans* (page table rows,
starts, tree mask, write rows → static buffers) and copies the inputs in:

    batch 3 at tier 3 → bucket 4: verify graph [4, 4] tokens, row 3 = the padding slot

Lifetime: a graph bakes in the *addresses* of every tensor its kernels read. A tensor made
outside the capture and referenced only by the captured closure (e.g. the extend graph's row
index `arange(B)` for `hidden[rows, last]`) would be freed once capture returns, its memory
handed to later allocations, and the replay would then gather with whatever lands there (the
LM drafter's extend graph tripped `index out of bounds` that way). `StageGraph.keep` therefore
holds the captured closure, and with it every tensor the graph reads, as long as the graph.

Tensor parallelism: a graph whose capture issued a collective (`models/parallel.Collectives`:
the verify and prefill graphs of a sharded target, whose layers all-reduce) must be replayed by
every rank at once, over the same plan and inputs. Every rank captures the same graphs in the
same order, so a graph's `index` names it on all of them; rank 0's such graphs report each plan,
load and replay to a `GraphMirror` (`parallel/lockstep.py`), which the followers repeat on
their own graph of that index. A graph without collectives (a sampled accept over the gathered
logits) is rank 0's alone.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from specpair.logging import get_logger
from specpair.models.parallel import Collectives
from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.gpu.attention import AttentionBackend
from specpair.runtime.gpu.staging import Staging
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout, eye_mask

log = get_logger(__name__)
T = TypeVar("T")


class GraphMirror(Protocol):
    """Hears what rank 0 does to a graph the other ranks replay with it (by graph index)."""

    def plan(self, graph: int, attention: int, layout: BatchLayout) -> None: ...

    def load(self, graph: int, name: str, src: Tensor | Sequence[FeatureRows]) -> None: ...

    def replay(self, graph: int) -> None: ...


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, … up to max_batch (max_batch itself included)."""
    out = [1]
    while out[-1] < max_batch:
        out.append(min(2 * out[-1], max_batch))
    return out


def verify_buckets(buckets: Sequence[int]) -> list[int]:
    """A verify's batch buckets: `buckets` and, between two of them a and b, a step of a / 4 (at
    least 8 requests). Past a few requests a verify's GEMMs are bound by their arithmetic, so a
    padding row costs what a real one does: 47 requests at tier 7 verify in 14.3 ms padded to
    64 × 8 rows, in 11.5 as 48 × 8 (an H200, the 8B target; `bench.gpu_rounds profile
    --batches 64:47 48:47`). The step grows with the bucket: past 32 requests a padded verify
    wastes at most a fifth of its rows, and the graphs' logits take about three times the
    memory of the powers of two alone (at max batch 256: 1568 rows a tier's token against 511).

        [1, 2, 4, 8, 16, 32, 64] → [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
        … 128, 256 → … 128, 160, 192, 224, 256
    """
    out = set(buckets)
    for a, b in itertools.pairwise(sorted(buckets)):
        step = max(8, a // 4)
        out.update(range(a + step, b, step))
    return sorted(out)


def bucket_of(batch: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= batch), None)


def pad_layout(layout: BatchLayout, batch: int, tokens: int, pad_slot: int) -> BatchLayout:
    """Pads a layout to [batch, tokens]: extra rows go to the padding slot, extra columns are
    invisible to real tokens (identity rows), so real outputs are unchanged."""
    b, t = layout.new_mask.shape[:2]
    mask = eye_mask(tokens).expand(batch, -1, -1).clone()
    mask[:b, :t, :t] = layout.new_mask
    slots = torch.full((batch,), pad_slot, dtype=torch.long)
    slots[:b] = layout.slots
    starts = torch.zeros(batch, dtype=torch.long)
    starts[:b] = layout.starts
    return BatchLayout(slots, starts, mask)


def pad2d(x: Tensor, rows: int, cols: int) -> Tensor:
    out = torch.zeros(rows, cols, *x.shape[2:], dtype=x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """x [B, ...] on its device, zero rows appended up to `rows`."""
    out = torch.zeros(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


class GraphAttention:
    """A graph's attention backend and write rows for [batch, tokens]: the Triton tree kernel
    where it serves (`tree`, whose page rows and starts a graph may fill itself), else
    flashinfer in CUDA-graph mode."""

    def __init__(self, cache: KVCache, batch: int, tokens: int, staging: Staging) -> None:
        self.cache, self.batch, self.tokens = cache, batch, tokens
        self.staging = staging
        self.tree = cache.attention.tree(batch, tokens)
        self.backend: AttentionBackend = (
            self.tree if self.tree is not None else cache.attention.flashinfer_graph(batch, tokens)
        )
        self.rows = torch.zeros(batch * tokens, dtype=torch.long, device=cache.device)
        self.attend = cache.attend(self.backend, self.rows)
        idle = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, -1, -1)
        self.idle = BatchLayout(
            torch.full((batch,), cache.pad_slot), torch.zeros(batch, dtype=torch.long), idle
        )
        self.mirror: tuple[GraphMirror, int, int] | None = None  # rank 0's: graph, attention
        self.plan(self.idle)

    def plan(self, layout: BatchLayout) -> None:
        if self.mirror is not None:
            mirror, graph, index = self.mirror
            mirror.plan(graph, index, layout)
        self.staging.copy(self.rows, self.cache.write_index(layout))
        self.backend.plan(layout, self.cache.page_table, self.staging)

    @property
    def on_device(self) -> bool:
        """The Triton tree attention's metadata is plain buffers: a graph can fill them."""
        return self.tree is not None

    def plan_pages(self, slots: list[int]) -> None:
        """Only the page rows of `slots` (padded): an `on_device` step's whole host plan."""
        assert self.tree is not None, "plan_pages: the tree kernel's graphs only"
        padded = torch.full((self.batch,), self.cache.pad_slot, dtype=torch.long)
        padded[: len(slots)] = torch.tensor(slots)
        self.staging.copy(self.tree.pages, self.cache.page_table[padded])

    def share_pages(self, first: GraphAttention) -> None:
        """Reads `first`'s page rows (one request's page row serves every step of a draft),
        so that planning `first`'s pages plans this one's too (`on_device` ones only)."""
        if self.tree is not None and first.tree is not None:
            self.tree.pages = first.tree.pages

    def follow(self, starts: Tensor) -> None:
        """Inside a graph: starts and write rows of the `tokens` new rows per request from
        device positions `starts` [B] on (`on_device` only), through the planned page rows."""
        assert self.tree is not None, "follow: the tree kernel's graphs only"
        page = self.cache.page_size
        self.tree.starts.copy_(starts)
        if self.tokens == 1:  # a chain's step
            pages = self.tree.pages.gather(1, (starts // page)[:, None])[:, 0]
            self.rows.copy_(pages.long() * page + starts % page)
            return
        pos = starts[:, None] + torch.arange(self.tokens, device=starts.device)  # [B, T]
        pages = self.tree.pages.gather(1, pos // page)
        self.rows.copy_((pages.long() * page + pos % page).view(-1))


@dataclass
class StageGraph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    attention: list[GraphAttention]
    keep: object = None  # the captured closure: keeps every tensor the graph reads alive
    staging: Staging = field(default_factory=Staging)  # its builder's (GraphCapture.staging)
    index: int = -1  # its place in its builder's captures: the same on every rank
    collective: bool = False  # its capture issued a collective: all ranks replay it together
    mirror: GraphMirror | None = None  # rank 0's, for a collective graph of a sharded target

    def load(self, name: str, src: Tensor) -> None:
        """Host tensor `src` into the static input `name` (asynchronously, see Staging)."""
        if self.mirror is not None:
            self.mirror.load(self.index, name, src)
        self.staging.copy(self.inputs[name], src)

    def load_rows(self, name: str, rows: Sequence[FeatureRows]) -> None:
        """Per-request host rows [n_b, ...] into the static input `name` [B', T', ...] at
        [b, :n_b], with no padded copy made first (`Staging.copy_rows`)."""
        if self.mirror is not None:
            self.mirror.load(self.index, name, rows)
        self.staging.copy_rows(self.inputs[name], rows)

    def replay(self) -> None:
        self.announce()
        self.graph.replay()

    def announce(self) -> None:
        """What precedes a replay: a mirrored graph tells the other ranks to replay theirs,
        then the staged copies are queued."""
        if self.mirror is not None:
            self.mirror.replay(self.index)
        self.staging.flush()

    def mirror_to(self, mirror: GraphMirror) -> None:
        """Reports this graph's plans, loads and replays to `mirror` from now on."""
        self.mirror = mirror
        for i, attention in enumerate(self.attention):
            attention.mirror = (mirror, self.index, i)


def capture(
    body: Callable[[], dict[str, Tensor]],
    inputs: dict[str, Tensor],
    attention: list[GraphAttention],
    pool: torch.cuda._POOL_HANDLE | None,
    staging: Staging,
) -> StageGraph:
    """Warms `body` up on a side stream (JIT, cuBLAS handles), then captures it."""
    issued = Collectives.issued
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = body()
    g = StageGraph(graph, inputs, outputs, attention, keep=body, staging=staging)
    g.collective = Collectives.issued > issued
    return g


class GraphCapture:
    """One worker's graph builder, shared by its tiers: buckets, one memory pool, the pinned
    staging of every graph, replay timing, and how many graphs it captured (`captures`)."""

    def __init__(
        self, cache: KVCache, max_batch: int, owner: str, buckets: Sequence[int] | None = None
    ) -> None:
        self.cache = cache
        self.buckets = sorted(buckets) if buckets else buckets_for(max_batch)
        self.pool = torch.cuda.graph_pool_handle()
        self.owner = owner
        self.captures = 0
        self.stats: dict[str, dict[str, float]] = {}  # by tier: "3", "4x4x16", "3 extend"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        self._spans = 0
        self.staging = Staging()
        self.graphs: list[StageGraph] = []  # in capture order: `StageGraph.index`

    def capture(
        self,
        body: Callable[[], dict[str, Tensor]],
        inputs: dict[str, Tensor],
        attention: list[GraphAttention],
    ) -> StageGraph:
        graph = capture(body, inputs, attention, self.pool, self.staging)
        graph.index = len(self.graphs)
        self.graphs.append(graph)
        self.captures += 1
        return graph

    def attention(self, batch: int, tokens: int) -> GraphAttention:
        return GraphAttention(self.cache, batch, tokens, self.staging)

    def replay(self, g: StageGraph) -> None:
        """Replays `g` between two CUDA events (four per call; older ones unread are dropped)."""
        self._spans %= len(self._events) // 2
        start, end = self._events[2 * self._spans], self._events[2 * self._spans + 1]
        g.announce()  # before the start event: the copies and the ranks' step are not its time
        start.record()
        g.graph.replay()
        end.record()
        self._spans += 1

    def read_gpu_ms(self) -> float:
        """GPU time of the replays since the last read; the caller has synchronized on their
        outputs."""
        ev = self._events
        ms = sum(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(self._spans))
        self._spans = 0
        return ms

    def timed(self, tier: str, build: Callable[[], T], buckets: Sequence[int] | None = None) -> T:
        """`build()`, its capture time, memory and graphs logged (`buckets`: the ones it
        captured, where not this builder's)."""
        # Capturing empties the allocator's cache (torch.cuda.graph does): empty it first, or
        # memory left cached by loading counts against the first tier's graphs.
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        t0, mem0, n0 = time.perf_counter(), torch.cuda.memory_reserved(), self.captures
        built = build()
        torch.cuda.synchronize()
        stats = {
            "seconds": time.perf_counter() - t0,
            "graph_mib": (torch.cuda.memory_reserved() - mem0) / 2**20,
            "graphs": float(self.captures - n0),
        }
        self.stats[tier] = stats
        buckets = list(buckets or self.buckets)
        log.info("captured CUDA graphs", owner=self.owner, tier=tier, buckets=buckets, **stats)
        return built
