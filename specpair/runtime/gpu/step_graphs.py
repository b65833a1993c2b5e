"""One tier's draft steps in CUDA graphs (`DraftGraphs.tier` builds them): planned, replayed,
read back once; greedy, or sampled (q read back with the tokens). Where no graph fits, the
drafter's eager steps run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from specpair.runtime.gpu.capture import (
    GraphCapture,
    StageGraph,
    bucket_of,
    pad2d,
    pad_layout,
    pad_rows,
)
from specpair.runtime.layout import BatchLayout
from specpair.runtime.stages import DraftQ, DraftSampling, DraftStage
from specpair.runtime.tree import CandidateTree


class StepPlanner(Protocol):
    """What the steps need of the `DraftGraphs` that built them (a Protocol: that module imports
    this one)."""

    capture: GraphCapture
    steps_paged: bool  # the extend ran on a plan made ahead, which paged the steps too

    def plan_step_pages(self, bucket: int, slots: list[int], ends: list[int]) -> None: ...


class StepGraphs:
    """One tier's draft stage: the bucket's graph of s steps; else the drafter's eager
    steps."""

    def __init__(
        self,
        graphs: StepPlanner,
        tier: int,
        eager: DraftStage,
        steps: dict[int, StageGraph],
        sampled: dict[int, StageGraph] | None = None,
    ) -> None:
        self.graphs, self.tier, self.eager, self.steps = graphs, tier, eager, steps
        self.sampled = sampled or {}
        self.sampled_replays = 0  # sampled rounds drafted in a graph
        self._planned: tuple[StageGraph, list[int]] | None = None  # graph, starts

    def plan(self, slots: list[int]) -> None:
        """Plans the greedy graph; the sampled graph of the bucket shares its step attention,
        so the greedy plan serves it too."""
        o, cache, s = self.graphs, self.graphs.capture.cache, self.tier
        self._planned = None
        bucket = bucket_of(len(slots), o.capture.buckets)
        starts = [cache.lengths[slot] for slot in slots]
        if bucket is None or bucket not in self.steps or max(starts) + s > cache.max_len:
            return  # the steps run eagerly
        if not o.steps_paged:  # else `prepare` planned the steps' pages
            o.plan_step_pages(bucket, slots, [st + s for st in starts])
        g = self.steps[bucket]
        for k, attn in enumerate(g.attention):
            if not attn.on_device:
                step = BatchLayout.causal(slots, [st + k for st in starts], [1] * len(slots))
                attn.plan(pad_layout(step, bucket, 1, cache.pad_slot))
        self._planned = (g, starts)

    def _replay(
        self, hidden: Tensor, slots: list[int], graph: StageGraph | None = None
    ) -> StageGraph:
        """Replays the planned graph, or `graph` in its place (the sampled twin)."""
        assert self._planned is not None
        (g, starts), self._planned = self._planned, None
        g = graph or g
        bucket, b = len(g.inputs["starts"]), len(slots)
        if hidden.shape[0] != bucket:  # from the eager extend
            hidden = pad_rows(hidden, bucket)
        g.inputs["hidden"].copy_(hidden)  # on the device: queued after the extend graph
        padded = torch.zeros(bucket, dtype=torch.long)
        padded[:b] = torch.tensor(starts)
        g.load("starts", padded)
        self.graphs.capture.replay(g)
        return g

    def run(
        self, hidden: Tensor, slots: list[int], depths: Sequence[int] | None = None
    ) -> list[list[int]]:
        if self._planned is None:
            return self.eager.run(hidden, slots, depths)
        g = self._replay(hidden, slots)
        drafts: list[list[int]] = g.outputs["tokens"][:, : len(slots)].T.tolist()
        return drafts

    def run_sampled(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        graph = None
        if self._planned is not None:
            graph = self.sampled.get(len(self._planned[0].inputs["starts"]))
        if self._planned is None or graph is None:
            self._planned = None
            return self.eager.run_sampled(hidden, slots, sampling, depths)
        bucket, b = len(graph.inputs["starts"]), len(slots)
        params = torch.ones(bucket, 5)  # padding rows: greedy
        params[:b] = sampling.params.table
        graph.load("params", params)
        graph.load("uniform", pad2d(sampling.u.T, self.tier, bucket))
        g = self._replay(hidden, slots, graph)
        self.sampled_replays += 1
        drafts: list[list[int]] = g.outputs["tokens"][:, :b].T.tolist()
        ids = g.outputs["q_ids"][:, :b].transpose(0, 1).cpu()  # [b, s, K]
        q = g.outputs["q"][:, :b].transpose(0, 1).cpu()
        qs: list[DraftQ | None] = [None if sampling.greedy[i] else (ids[i], q[i]) for i in range(b)]
        return drafts, qs

    def run_tree(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling | None = None,
        depths: Sequence[int] | None = None,
    ) -> list[CandidateTree]:
        return self.eager.run_tree(hidden, slots, sampling, depths)

    def read_gpu_ms(self) -> float:
        return self.graphs.capture.read_gpu_ms()
