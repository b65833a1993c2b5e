"""A tree shape's draft in CUDA graphs, one per batch bucket: `tree_grow.grow_tree` captured
whole, so the steps need no host work; the host plans the page rows before the replay and
reads the candidate pool back once after it, for the rerank.

Step d (1 … steps − 1) runs the d · topk expanded nodes through the Triton tree kernel of
[bucket, d · topk] rows, whose metadata are static buffers the graph fills itself: the tree
mask it grew from its own top-k picks, the starts, and the write rows (positions start …
start + d · topk − 1 through the page rows planned for every step at once, which the steps'
kernels share). A shape whose widest step does not fit the kernel ((steps − 1) · topk rows ×
the GQA group > its MAX_ROWS), or a graph attention of flashinfer (planned on the host), drafts
eagerly (`draft/tree_draft.py`).

    4x4x16, Llama-3-8B's 4 q heads per KV head: steps of 4, 8 and 12 rows, 48 kernel rows at
    most: in graphs. 6x8x32: 40 rows × 4 = 160 > 128: eager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.runtime.gpu.capture import (
    GraphAttention,
    GraphCapture,
    StageGraph,
    bucket_of,
    pad_rows,
)
from specpair.runtime.gpu.draft_graphs import DraftGraphs, ExtendGraphs
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftModel, DraftQ, DraftSampling, DraftStage, ExtendStage
from specpair.runtime.tree import CandidateTree
from specpair.runtime.tree_grow import grow_tree, rerank_trees


def tree_graph(
    capture: GraphCapture, d: DraftModel, attns: list[GraphAttention], batch: int, shape: TreeShape
) -> StageGraph:
    """The graph of one bucket: `hidden` [B, 1, H] (the extend's), `starts` [B] and
    `temperature` [B, 1] in; the pool `tokens`, `scores`, `parents` [B, P] out. `attns[d - 1]`:
    step d's attention over d · topk rows."""
    dev = capture.cache.device
    inputs = {
        "hidden": torch.zeros(batch, 1, d.args.hidden_size, dtype=capture.cache.dtype, device=dev),
        "starts": torch.zeros(batch, dtype=torch.long, device=dev),
        "temperature": torch.ones(batch, 1, device=dev),
    }

    def forward(tokens: Tensor, feats: Tensor | None, positions: Tensor, mask: Tensor) -> Tensor:
        attn = attns[tokens.shape[1] // shape.topk - 1]
        assert attn.tree is not None
        attn.tree.mask.copy_(mask)
        attn.follow(inputs["starts"])
        return d.forward(tokens, feats, positions, attn.attend)

    def body() -> dict[str, Tensor]:
        pool = grow_tree(
            d.logits,
            d.needs_features,
            inputs["hidden"],
            inputs["starts"],
            shape,
            inputs["temperature"],
            forward,
        )
        return dict(zip(("tokens", "scores", "parents"), pool, strict=True))

    return capture.capture(body, inputs, attns)


def tree_stages(
    graphs: DraftGraphs, shape: TreeShape, eager_extend: ExtendStage, eager_draft: DraftStage
) -> tuple[ExtendGraphs, TreeGraphs]:
    """A tree shape's draft stages: the extend graphs of its depth (steps + 1 rows, shared with
    the chain tier of as many steps) and its own draft graphs."""
    width = shape.steps + 1
    graphs.capture.timed(f"{shape.steps} extend", lambda: graphs.extend_graphs(width))
    extend = ExtendGraphs(graphs, shape.steps, eager_extend)
    return extend, TreeGraphs(graphs.capture, graphs.model, shape, eager_draft)


class TreeGraphs:
    """A tree shape's draft stage: `run_tree` replays the bucket's graph (or, where none fits,
    runs `eager`'s); the chain methods are `eager`'s (a tree tier drafts none)."""

    def __init__(
        self, capture: GraphCapture, model: DraftModel, shape: TreeShape, eager: DraftStage
    ) -> None:
        self.capture, self.cache, self.shape, self.eager = capture, capture.cache, shape, eager
        self.graphs: dict[int, StageGraph] = {}
        self.replays = 0  # trees drafted in a graph
        widths = [d * shape.topk for d in range(1, shape.steps)]
        if not all(self.cache.attention.tree_fits(t) for t in widths):
            return

        def build() -> dict[int, StageGraph]:
            graphs = {}
            for b in capture.buckets:
                attns = [capture.attention(b, t) for t in widths]
                for a in attns[1:]:
                    a.share_pages(attns[0])
                graphs[b] = tree_graph(capture, model, attns, b, shape)
            return graphs

        self.graphs = capture.timed(f"{shape} draft", build)

    def run_tree(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling | None = None,
        depths: Sequence[int] | None = None,
    ) -> list[CandidateTree]:
        b, shape, cache = len(slots), self.shape, self.cache
        bucket = bucket_of(b, self.capture.buckets)
        g = self.graphs.get(bucket) if bucket is not None else None
        if g is None or bucket is None:
            return self.eager.run_tree(hidden, slots, sampling, depths)
        starts = [cache.lengths[slot] for slot in slots]
        try:
            for slot, start in zip(slots, starts, strict=True):
                cache.reserve(slot, start + shape.draft_rows)
        except CacheFullError:
            return self.eager.run_tree(hidden, slots, sampling, depths)  # it reports the room
        g.attention[0].plan_pages(slots)
        padded = torch.zeros(bucket, dtype=torch.long)
        padded[:b] = torch.tensor(starts)
        g.load("starts", padded)
        temperature = torch.ones(bucket, 1)  # greedy and padding rows rank at 1
        if sampling is not None:
            temperature[:b] = sampling.params.temperature
        g.load("temperature", temperature)
        if hidden.shape[0] != bucket:  # from the eager extend
            hidden = pad_rows(hidden, bucket)
        g.inputs["hidden"].copy_(hidden)  # on the device: queued after the extend graph
        self.capture.replay(g)
        self.replays += 1
        pool = (g.outputs["tokens"], g.outputs["scores"], g.outputs["parents"])
        return rerank_trees(pool, shape, b, depths)

    def plan(self, slots: list[int]) -> None:
        self.eager.plan(slots)

    def run(
        self, hidden: Tensor, slots: list[int], depths: Sequence[int] | None = None
    ) -> list[list[int]]:
        return self.eager.run(hidden, slots, depths)

    def run_sampled(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        return self.eager.run_sampled(hidden, slots, sampling, depths)

    def read_gpu_ms(self) -> float:
        return self.capture.read_gpu_ms()
