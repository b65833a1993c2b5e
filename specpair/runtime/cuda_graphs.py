"""Per-tier CUDA graphs: target verify, draft extend and draft multi-step, per batch bucket.

Built at start-up by `build_states(tiers, [worker, drafter])` (each GPU worker's `graphs` is
its builder), stored in `state.extras`, so a tier switch stays a reference swap. Each graph runs
over static input/output buffers and an attention whose metadata lives in static buffers (the
Triton tree attention of `tree_attention.py`, or flashinfer in CUDA-graph mode with
`graph_attention="flashinfer"`); before a replay the host *plans* (page table rows, starts, tree
mask, write rows → static buffers) and copies the inputs in:

    batch 3 at tier 3 → bucket 4: verify graph [4, 4] tokens, row 3 = the padding slot

Stages and their graphs (s = tier):
- verify: B × (s + 1) tree tokens → hidden [B, s + 1, H], logits [B, s + 1, V];
- extend: B × (s + 1) appended tokens (accepted + bonus; longer rounds, e.g. a first round's
  prompt, run eagerly) → hidden of each request's last row [B, 1, H];
- draft: s greedy steps of one token per request, argmax inside the graph → tokens [s, B].
  Sampling rounds run the eager loop: their per-request warps and generators stay on the host.
`captures()` counts graph captures; tests assert it stays flat after start-up.

Lifetime: a graph bakes in the *addresses* of every tensor its kernels read. A tensor made
outside the capture and referenced only by the captured closure (e.g. the extend graph's row
index `arange(B)` for `hidden[rows, last]`) would be freed once capture returns, its memory
handed to later allocations, and the replay would then gather with whatever lands there (the
LM drafter's extend graph tripped `index out of bounds` that way). `StageGraph.keep` therefore
holds the captured closure, and with it every tensor the graph reads, as long as the graph.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specpair.logging import get_logger
from specpair.runtime.kv_cache import BatchLayout, CacheFullError, eye_mask, tril_mask
from specpair.runtime.paged_kv import PagedKVCache

log = get_logger(__name__)
_captures = 0


def captures() -> int:
    """CUDA graphs this process has captured so far."""
    return _captures


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, … up to max_batch (max_batch itself included)."""
    out = [1]
    while out[-1] < max_batch:
        out.append(min(2 * out[-1], max_batch))
    return out


def bucket_of(batch: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= batch), None)


class Staging:
    """Host-to-device copies into static buffers through pinned twins, one per buffer.

    A copy from pageable memory first waits for all work queued on the stream, so the host
    could not prepare a graph's inputs while the previous graph ran; from a pinned twin the
    copy is asynchronous. A twin is rewritten only in a later call, after that call's caller
    has synchronized on the previous outputs (every stage ends reading its results).

    Copies made `deferred` (plans made ahead, `prepare`) wait in `pending` until the next
    replay flushes them: a service plans while its peer computes, and on a shared GPU a copy
    queued in one process's context then would preempt the peer's kernels (time-slicing
    between contexts; an H100 run measured the target's verify graphs 4 % slower on the GPU
    while the draft's plan copies went out during them).
    """

    def __init__(self) -> None:
        self.twins: dict[int, tuple[Tensor, Tensor]] = {}  # id(buffer) → (buffer, twin)
        self.pending: list[tuple[Tensor, Tensor]] = []  # (static buffer, its twin)
        self.defer = False

    def copy(self, dst: Tensor, src: Tensor) -> None:
        entry = self.twins.get(id(dst))
        if entry is None:  # the entry holds the buffer too: its id is never reused meanwhile
            entry = self.twins[id(dst)] = (dst, torch.empty_like(dst, device="cpu").pin_memory())
        twin = entry[1]
        twin.copy_(src)
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


class GraphAttention:
    """A graph's attention (`PagedKVCache.graph_wrapper`) and write rows for [batch, tokens]."""

    def __init__(self, cache: PagedKVCache, batch: int, tokens: int, staging: Staging) -> None:
        self.cache, self.batch, self.tokens = cache, batch, tokens
        self.staging = staging
        self.wrapper = cache.graph_wrapper(batch, tokens)
        self.rows = torch.zeros(batch * tokens, dtype=torch.long, device=cache.device)
        self.attend = cache.attend_fn(self.wrapper, self.rows)
        idle = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, -1, -1)
        self.idle = BatchLayout(
            torch.full((batch,), cache.pad_slot), torch.zeros(batch, dtype=torch.long), idle
        )
        self.plan(self.idle)

    def plan(self, layout: BatchLayout) -> None:
        self.staging.copy(self.rows, self.cache.write_index(layout))
        self.cache.plan(self.wrapper, layout, self.staging)

    @property
    def on_device(self) -> bool:
        """The Triton tree attention's metadata is plain buffers: a graph can fill them."""
        return hasattr(self.wrapper, "starts")

    def plan_pages(self, slots: list[int]) -> None:
        """Only the page rows of `slots` (padded): an `on_device` step's whole host plan."""
        padded = torch.full((self.batch,), self.cache.pad_slot, dtype=torch.long)
        padded[: len(slots)] = torch.tensor(slots)
        self.staging.copy(self.wrapper.pages, self.cache.page_table[padded])

    def follow(self, starts: Tensor) -> None:
        """Inside a graph: starts and write rows of one new token per request at device
        positions `starts` [B] (`on_device` only), through the planned page rows."""
        page = self.cache.page_size
        self.wrapper.starts.copy_(starts)
        pages = self.wrapper.pages.gather(1, (starts // page)[:, None])[:, 0]
        self.rows.copy_(pages.long() * page + starts % page)


@dataclass
class StageGraph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    attention: list[GraphAttention]
    keep: object = None  # the captured closure: keeps every tensor the graph reads alive
    staging: Staging = field(default_factory=Staging)  # its owner's (_Capturer.staging)

    def load(self, name: str, src: Tensor) -> None:
        """Host tensor `src` into the static input `name` (asynchronously, see Staging)."""
        self.staging.copy(self.inputs[name], src)


def capture(
    body: Callable[[], dict[str, Tensor]],
    inputs: dict[str, Tensor],
    attention: list[GraphAttention],
    pool: Any,
    staging: Staging | None = None,
) -> StageGraph:
    """Warms `body` up on a side stream (JIT, cuBLAS handles), then captures it."""
    global _captures
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = body()
    _captures += 1
    return StageGraph(graph, inputs, outputs, attention, keep=body, staging=staging or Staging())


class _Capturer:
    """Shared by both workers: buckets, one memory pool, timing and memory logs per tier."""

    def __init__(
        self, cache: PagedKVCache, max_batch: int, owner: str, buckets: Sequence[int] | None
    ) -> None:
        self.cache = cache
        self.buckets = sorted(buckets) if buckets else buckets_for(max_batch)
        self.pool = torch.cuda.graph_pool_handle()
        self.owner = owner
        self.stats: dict[int, dict[str, float]] = {}
        self.last_gpu_ms = 0.0  # GPU time of the last call's graph replays (0: none ran)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
        self._spans = 0
        self.staging = Staging()  # of every graph and attention here

    def replay(self, g: StageGraph) -> None:
        """Replays `g` between two CUDA events (four per call; older ones unread are dropped)."""
        self._spans %= len(self._events) // 2
        start, end = self._events[2 * self._spans], self._events[2 * self._spans + 1]
        self.staging.flush()
        start.record()
        g.graph.replay()
        end.record()
        self._spans += 1

    def read_gpu_ms(self) -> float:
        """GPU time of this call's replays; the caller has synchronized on their outputs."""
        ev = self._events
        self.last_gpu_ms = sum(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(self._spans))
        self._spans = 0
        return self.last_gpu_ms

    def timed(self, tier: int, build: Callable[[], object]) -> object:
        # Capturing empties the allocator's cache (torch.cuda.graph does): empty it first, or
        # memory left cached by loading counts against the first tier (-8.7 GiB on an H100).
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved()
        built = build()
        torch.cuda.synchronize()
        stats = {
            "seconds": time.perf_counter() - t0,
            "graph_mib": (torch.cuda.memory_reserved() - mem0) / 2**20,
            "graphs": float(len(self.buckets)),
        }
        self.stats[tier] = stats
        log.info("captured CUDA graphs", owner=self.owner, tier=tier, buckets=self.buckets, **stats)
        return built


class TargetGraphs(_Capturer):
    """Verify graphs of a `TargetWorker` whose model is fused and whose cache is paged."""

    def __init__(self, worker: Any, max_batch: int, buckets: Sequence[int] | None = None) -> None:
        super().__init__(worker.cache, max_batch, "target", buckets)
        self.worker = worker

    def capture_tier(self, state: Any) -> None:
        tokens = state.tier + 1
        graphs = self.timed(state.tier, lambda: {b: self._verify(b, tokens) for b in self.buckets})
        state.extras[f"verify/{id(self.worker)}"] = VerifyGraphs(self, graphs)  # type: ignore[arg-type]

    def _verify(self, batch: int, tokens: int) -> StageGraph:
        model, dev = self.worker.model, self.cache.device
        inputs = {
            "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
            "positions": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        }
        attn = GraphAttention(self.cache, batch, tokens, self.staging)

        def body() -> dict[str, Tensor]:
            hidden = model(inputs["tokens"], inputs["positions"], attn.attend)
            return {"hidden": hidden, "logits": model.logits(hidden)}

        return capture(body, inputs, [attn], self.pool, self.staging)


class VerifyGraphs:
    """One tier's verify graphs. `plan` picks the bucket graph, plans its attention and loads
    the positions; `replay` loads the tokens and runs it. A plan made ahead carries a `key`
    (what it depends on) and serves the one verify whose key matches."""

    def __init__(self, owner: TargetGraphs, graphs: dict[int, StageGraph]) -> None:
        self.owner, self.graphs = owner, graphs
        self._planned: tuple[StageGraph, int, object] | None = None  # graph, batch, key
        self.ahead = 0  # verifies that ran on a plan made ahead

    def plan(self, positions: Tensor, layout: BatchLayout, key: object = None) -> bool:
        """False when no graph fits (the caller runs eagerly). A plan made ahead (`key`) defers
        its copies to the replay (see Staging)."""
        self._planned = None
        b, t = positions.shape
        bucket = bucket_of(b, self.owner.buckets)
        if bucket is None:
            return False
        g = self.graphs[bucket]
        tg = g.inputs["tokens"].shape[1]
        if t > tg or int(layout.starts.max()) + tg > self.owner.cache.max_len:
            return False
        with self.owner.staging.deferred() if key is not None else nullcontext():
            g.attention[0].plan(pad_layout(layout, bucket, tg, self.owner.cache.pad_slot))
            g.load("positions", pad2d(positions, bucket, tg))
        self._planned = (g, b, key)
        return True

    def planned_for(self, key: object) -> bool:
        hit = self._planned is not None and self._planned[2] == key
        self.ahead += hit
        return hit

    def replay(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Runs the planned graph on host `tokens` [B, T]: hidden [B, T, H], logits [B, T, V]."""
        assert self._planned is not None, "replay without a plan"
        g, b, _ = self._planned
        self._planned = None  # a plan serves one replay: the next verify plans afresh
        tg = g.inputs["tokens"].shape[1]
        g.load("tokens", pad2d(tokens, len(g.inputs["tokens"]), tg))
        self.owner.replay(g)
        t = tokens.shape[1]
        return g.outputs["hidden"][:b, :t], g.outputs["logits"][:b, :t]


class DraftGraphs(_Capturer):
    """Extend and multi-step graphs of a `Drafter` (LM or EAGLE) over a paged cache."""

    def __init__(self, drafter: Any, max_batch: int, buckets: Sequence[int] | None = None) -> None:
        super().__init__(drafter.cache, max_batch, "draft", buckets)
        self.profile = False  # when set, round() synchronizes to time extend and draft apart
        self.last_times = (0.0, 0.0)  # (extend s, draft s) of the last profiled round
        self.drafter = drafter
        self.steps: dict[int, list[GraphAttention]] = {b: [] for b in self.buckets}
        self.extends: dict[tuple[int, int], StageGraph] = {}  # (bucket, tokens) → graph
        self.planned: tuple[object, StageGraph] | None = None  # (key, extend) from `prepare`
        self.ahead = 0  # rounds whose extend ran on a plan made ahead

    def capture_tier(self, state: Any) -> None:
        s = state.tier

        def build() -> dict[int, StageGraph]:
            for b in self.buckets:
                self.extends[(b, s + 1)] = self._extend(b, s + 1)
            return {b: self._multi_step(b, s) for b in self.buckets}

        steps = self.timed(s, build)
        state.extras[f"draft/{id(self.drafter)}"] = TierDraftGraphs(self, s, steps)  # type: ignore[arg-type]

    def _extend(self, batch: int, tokens: int) -> StageGraph:
        d, dev = self.drafter, self.cache.device
        hidden_size = d.args.hidden_size
        inputs = {
            "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
            "positions": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
            "last": torch.zeros(batch, dtype=torch.long, device=dev),
        }
        if d.needs_features:
            inputs["features"] = torch.zeros(batch, tokens, hidden_size, device=dev)
        attn = GraphAttention(self.cache, batch, tokens, self.staging)
        inputs["rows"] = torch.arange(batch, device=dev)  # static: read by the graph's gather
        rows = inputs["rows"]

        def body() -> dict[str, Tensor]:
            feats = inputs.get("features")
            hidden = d.forward(inputs["tokens"], feats, inputs["positions"], attn.attend)
            return {"hidden": hidden[rows, inputs["last"]][:, None]}  # [B, 1, H]

        return capture(body, inputs, [attn], self.pool, self.staging)

    def _multi_step(self, batch: int, s: int) -> StageGraph:
        d, dev = self.drafter, self.cache.device
        attns = self.steps[batch]
        while len(attns) < s - 1:  # step k's attention is the same whatever the tier
            attns.append(GraphAttention(self.cache, batch, 1, self.staging))
            if attns[-1].on_device:  # one request's page row serves every step
                attns[-1].wrapper.pages = attns[0].wrapper.pages
        inputs = {
            "hidden": torch.zeros(batch, 1, d.args.hidden_size, dtype=self.cache.dtype, device=dev),
            "starts": torch.zeros(batch, dtype=torch.long, device=dev),
        }

        def body() -> dict[str, Tensor]:
            hidden, out = inputs["hidden"], []
            for k in range(s):
                token = d.logits(hidden).argmax(-1)  # [B]
                out.append(token)
                if k + 1 < s:
                    pos = inputs["starts"] + k  # [B]
                    if attns[k].on_device:
                        attns[k].follow(pos)
                    hidden = d.forward(token[:, None], hidden, pos[:, None], attns[k].attend)
            return {"tokens": torch.stack(out)}  # [s, B]

        return capture(body, inputs, attns[: s - 1], self.pool, self.staging)


class TierDraftGraphs:
    def __init__(self, owner: DraftGraphs, tier: int, steps: dict[int, StageGraph]) -> None:
        self.owner, self.tier, self.steps = owner, tier, steps

    def prepare(self, slots: list[int]) -> None:
        """Plans the next round's extend of `slots` before its tokens arrive: pages, starts
        and positions follow from the committed lengths; only tokens (and features) and each
        request's last row depend on the target's verdict. The draft service calls this while
        the target verifies; the next round uses the plan when its slots and starts match."""
        o, cache, s = self.owner, self.owner.cache, self.tier
        o.planned = None
        bucket = bucket_of(len(slots), o.buckets)
        if bucket is None:
            return
        ext = o.extends.get((bucket, s + 1))
        starts = [cache.lengths[slot] for slot in slots]
        if ext is None or max(starts) + 2 * s + 1 > cache.max_len:
            return  # the round runs eagerly
        try:
            with o.staging.deferred():
                _plan_extend(ext, cache, slots, starts)
                # the steps write after the extend's rows: at most s + 1 + s past the start
                self._plan_step_pages(bucket, slots, [st + 2 * s + 1 for st in starts])
        except CacheFullError:
            return  # the round itself reports it
        o.planned = ((s, tuple(slots), tuple(starts), cache.generation), ext)

    def _plan_step_pages(self, bucket: int, slots: list[int], ends: list[int]) -> bool:
        """Pages up to `ends` and their rows for steps that place themselves (`on_device`)."""
        attns = self.steps[bucket].attention
        if not attns or not attns[0].on_device:
            return False
        for slot, end in zip(slots, ends, strict=True):
            self.owner.cache.reserve(slot, end)
        attns[0].plan_pages(slots)
        return True

    def round(self, drafter: Any, inputs: Sequence[Any], slots: list[int]) -> list[list[int]]:
        """Greedy draft round: extend (graph when it fits, else eager), then s graph steps."""
        o, cache, s = self.owner, self.owner.cache, self.tier
        b = len(inputs)
        bucket = bucket_of(b, o.buckets)
        tokens, feats, positions, layout, lengths = drafter.extend_inputs(inputs, slots)
        before = layout.starts.tolist()  # committed lengths before this round's rows
        starts = [cache.lengths[slot] for slot in slots]
        planned, o.planned = o.planned, None
        if bucket is None or max(starts) + s > cache.max_len:
            o.last_gpu_ms = 0.0
            return self._eager(drafter, tokens, feats, positions, layout, lengths, slots)
        t0 = time.perf_counter()
        t = tokens.shape[1]
        ext = planned_ext = None
        key = (s, tuple(slots), tuple(before), cache.generation)
        if planned is not None and planned[0] == key and planned[1].inputs["tokens"].shape[1] >= t:
            ext = planned_ext = planned[1]  # planned by `prepare`
            o.ahead += 1
        fits = sorted(k[1] for k in o.extends if k[0] == bucket and k[1] >= t)
        if ext is None and fits and max(before) + fits[0] <= cache.max_len:
            ext = o.extends[(bucket, fits[0])]
            _plan_extend(ext, cache, slots, before)
        if ext is not None:
            tg = ext.inputs["tokens"].shape[1]
            ext.load("tokens", pad2d(tokens, bucket, tg))
            last = torch.zeros(bucket, dtype=torch.long)
            last[:b] = torch.tensor(lengths) - 1
            ext.load("last", last)
            if feats is not None:
                ext.load("features", pad2d(feats, bucket, tg))
            o.replay(ext)
            hidden = ext.outputs["hidden"]
        else:
            hidden = pad2d_dev(
                drafter_last(drafter, tokens, feats, positions, layout, lengths), bucket
            )
        if o.profile:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        g = self.steps[bucket]
        if planned_ext is None:  # else `prepare` planned the steps' pages too
            self._plan_step_pages(bucket, slots, [st + s for st in starts])
        for k, attn in enumerate(g.attention):
            if not attn.on_device:
                step = BatchLayout.causal(slots, [st + k for st in starts], [1] * b)
                attn.plan(pad_layout(step, bucket, 1, cache.pad_slot))
        g.inputs["hidden"].copy_(hidden)  # on the device: queued after the extend graph
        padded = torch.zeros(bucket, dtype=torch.long)
        padded[:b] = torch.tensor(starts)
        g.load("starts", padded)
        o.replay(g)
        drafts: list[list[int]] = g.outputs["tokens"][:, :b].T.tolist()
        o.read_gpu_ms()
        o.last_times = (t1 - t0, time.perf_counter() - t1)
        return drafts

    def _eager(
        self,
        drafter: Any,
        tokens: Tensor,
        feats: Tensor | None,
        positions: Tensor,
        layout: BatchLayout,
        lengths: list[int],
        slots: list[int],
    ) -> list[list[int]]:
        hidden = drafter_last(drafter, tokens, feats, positions, layout, lengths)
        starts = [self.owner.cache.lengths[slot] for slot in slots]
        out: list[Tensor] = []
        for k in range(self.tier):
            token = drafter.logits(hidden).argmax(-1)
            out.append(token)
            if k + 1 < self.tier:
                step = BatchLayout.causal(slots, [st + k for st in starts], [1] * len(slots))
                hidden = drafter._step(token[:, None], hidden, step)
        return torch.stack(out).T.tolist()  # type: ignore[no-any-return]


def _plan_extend(ext: StageGraph, cache: PagedKVCache, slots: list[int], starts: list[int]) -> None:
    """An extend graph's attention and positions for requests appending after `starts`: a
    causal block of the graph's width per request (rows past a request's own are padding
    whose K/V the draft steps overwrite), positions start + [0, width)."""
    bucket, width = ext.inputs["tokens"].shape
    b = len(slots)
    layout = BatchLayout(
        torch.tensor(slots), torch.tensor(starts), tril_mask(width).expand(b, -1, -1)
    )
    ext.attention[0].plan(pad_layout(layout, bucket, width, cache.pad_slot))
    ext.load("positions", pad2d(layout.starts[:, None] + torch.arange(width), bucket, width))


def drafter_last(
    drafter: Any,
    tokens: Tensor,
    feats: Tensor | None,
    positions: Tensor,
    layout: BatchLayout,
    lengths: list[int],
) -> Tensor:
    """Eager extend: hidden of each request's last appended row [B, 1, H]."""
    dev = drafter.device
    hidden = drafter.forward(
        tokens.to(dev),
        None if feats is None else feats.to(dev),
        positions.to(dev),
        drafter.cache.bind(layout),
    )
    return hidden[torch.arange(len(lengths)), torch.tensor(lengths) - 1][:, None]


def pad2d_dev(x: Tensor, rows: int) -> Tensor:
    out = torch.zeros(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out
