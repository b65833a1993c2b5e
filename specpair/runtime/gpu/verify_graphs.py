"""The verify stage in CUDA graphs: B × T tree tokens → hidden [B, T, H], logits (T: a chain's
s + 1, a tree shape's root and kept nodes).

One graph per batch bucket of a tier (`verify_buckets`: finer than the other stages'); a
verify that no graph fits (a batch past the largest bucket, a tree past the cache's end) runs
the eager stage instead. A sampled round's accept has a graph of its own per bucket, reading
the verify graph's logits in place: the warp, the draws and the rejection of every chain in one
replay over each row's candidates (eagerly some fifty kernel launches and two syncs: 2.9-3.4 ms
of an H200's host at 1 to 64 requests, against 0.35-2.1 ms replayed, `bench.gpu_kernels
sampling`); over the whole vocabulary (a batch with an unfiltered sampled row) up to
VOCABULARY_ACCEPT_BATCH.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

import specpair.runtime.sampling as sampling
from specpair.models.llama import LlamaModel
from specpair.runtime.accept import accept_chains
from specpair.runtime.accept_batch import (
    ChainBatch,
    TreeBatch,
    accept_candidates,
    accept_tree_candidates,
)
from specpair.runtime.gpu.capture import (
    GraphCapture,
    StageGraph,
    bucket_of,
    pad2d,
    pad_layout,
    verify_buckets,
)
from specpair.runtime.layout import BatchLayout
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import VerifyStage

# Past it an accept over the vocabulary runs eagerly: its graph holds p and q as [B, T, V]
# floats (64 tier-7 chains: 0.5 GB of the graphs' pool for p alone)
VOCABULARY_ACCEPT_BATCH = 16


def verify_graph(
    capture: GraphCapture,
    model: LlamaModel,
    batch: int,
    tokens: int,
    feature_layers: tuple[int, ...] = (),
) -> StageGraph:
    """The graph of one bucket: static tokens and positions [batch, tokens] in; out the
    logits and the features an EAGLE head reads (`LlamaModel.forward_aux`: the final hidden
    state [B, T, H], or `feature_layers`' outputs [B, T, 3H] for EAGLE-3) as `hidden`."""
    dev = capture.cache.device
    inputs = {
        "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        "positions": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
    }
    attn = capture.attention(batch, tokens)

    def body() -> dict[str, Tensor]:
        hidden, features = model.forward_aux(
            inputs["tokens"], inputs["positions"], attn.attend, feature_layers
        )
        return {"hidden": features, "logits": model.logits(hidden)}

    return capture.capture(body, inputs, [attn])


def accept_graph(capture: GraphCapture, logits: Tensor, general: bool) -> StageGraph:
    """The sampled accept of a verify graph's batch, from its logits [B, T, V] in place: the
    rows' `params` [B * T, 5], `drafts` [B, T - 1], `lengths` [B], uniforms `u` [B, T] and q
    sparse (`q_ids`, `q` [B, T - 1, K]) in; `verdicts` [3, B] out: accepted drafts, last
    token, and whether every row's warp cut fell among its candidates (else: accept eagerly).
    Not `general`: for batches whose every sampled request has a filter (top-k, top-p or
    min-p), greedy requests among them: `accept_candidates`, over each row's candidates, not
    the vocabulary (padding rows are greedy). `general`: the warp and rejection over the
    whole vocabulary that an unfiltered row's softmax needs."""
    b, t, v = logits.shape
    dev, k = logits.device, sampling.DRAFT_SUPPORT
    inputs = {
        "params": torch.ones(b * t, 5, device=dev),  # RowParams.table; padding rows greedy
        "drafts": torch.zeros(b, t - 1, dtype=torch.long, device=dev),
        "lengths": torch.zeros(b, dtype=torch.long, device=dev),
        "u": torch.full((b, t), 0.5, device=dev),
        "q_ids": torch.zeros(b, t - 1, k, dtype=torch.long, device=dev),
        "q": torch.zeros(b, t - 1, k, device=dev),
    }

    def body() -> dict[str, Tensor]:
        params = sampling.RowParams(inputs["params"], True, general, True)
        drafts, lengths, u = inputs["drafts"], inputs["lengths"], inputs["u"]
        if not general:
            accepted, last, covered = accept_candidates(
                logits, params, drafts, lengths, u, inputs["q_ids"], inputs["q"]
            )
            return {"verdicts": torch.stack([accepted, last, covered.long()])}
        p, rows_covered = sampling.warp_candidates(logits.view(b * t, v), params)
        assert rows_covered is not None
        q = torch.zeros(b, t - 1, v, device=dev).scatter_add_(-1, inputs["q_ids"], inputs["q"])
        accepted, last = accept_chains(p.view(b, t, v), q, drafts, lengths, u)
        return {"verdicts": torch.stack([accepted, last, rows_covered.view(b, t).all(-1).long()])}

    return capture.capture(body, inputs, [])


def tree_accept_graph(capture: GraphCapture, logits: Tensor) -> StageGraph:
    """The sampled accept of a tree shape's verified batch, from its logits [B, T, V] in
    place, for batches whose sampled rows filter (`accept_tree_candidates`): `params`
    [B * T, 5], full-tree `tokens`, `parents` and uniforms `u` [B, T] in; `verdicts`
    [T + 2, B] out: the last token, whether the request is covered, then node j accepted
    (j ≥ 1; row 2 is the root's, never). Padding requests are greedy over a lone root."""
    b, t, _ = logits.shape
    dev = logits.device
    inputs = {
        "params": torch.ones(b * t, 5, device=dev),
        "tokens": torch.zeros(b, t, dtype=torch.long, device=dev),
        "parents": torch.full((b, t), -1, dtype=torch.long, device=dev),
        "u": torch.full((b, t), 0.5, device=dev),
    }

    def body() -> dict[str, Tensor]:
        params = sampling.RowParams(inputs["params"], True, False, True)
        accepted, last, covered = accept_tree_candidates(
            logits, params, inputs["tokens"], inputs["parents"], inputs["u"]
        )
        rows = [last[None], covered.long()[None], accepted.long().T]
        return {"verdicts": torch.cat(rows)}

    return capture.capture(body, inputs, [])


class VerifyGraphs:
    """One tier's verify stage. `plan` picks the bucket graph, plans its attention and loads
    the positions; `run` loads the tokens and replays it. A plan made ahead (`prepare`) carries
    a `key` (what it depends on) and serves the one verify whose key matches."""

    plans_ahead = True

    def __init__(
        self,
        capture: GraphCapture,
        model: LlamaModel,
        shape: TreeShape,
        eager: VerifyStage,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        """Graphs of `shape.verified` tokens (the root and the kept nodes: a chain's s + 1);
        `eager`: the verify of a batch no graph fits; `feature_layers`: an EAGLE-3 draft's."""
        self.capture, self.cache, self.eager = capture, capture.cache, eager
        self.buckets = verify_buckets(capture.buckets)

        def build() -> tuple[dict[int, StageGraph], dict[tuple[int, bool], StageGraph]]:
            graphs = {
                b: verify_graph(capture, model, b, shape.verified, feature_layers)
                for b in self.buckets
            }
            if not shape.is_chain:
                return graphs, {
                    (b, False): tree_accept_graph(capture, g.outputs["logits"])
                    for b, g in graphs.items()
                }
            accepts = {
                (b, general): accept_graph(capture, g.outputs["logits"], general)
                for b, g in graphs.items()
                for general in (False, True)
                if not general or b <= VOCABULARY_ACCEPT_BATCH
            }
            return graphs, accepts

        self.graphs, self.accepts = capture.timed(str(shape), build, self.buckets)
        self._planned: tuple[StageGraph, int, object] | None = None  # graph, batch, key
        self._ran: tuple[int, int] | None = None  # the last run's (bucket, batch), in a graph
        self.rows = 0  # the last run's rows, its bucket's padding included
        self.graph_accepts = 0  # sampled accepts that ran in an accept graph
        self._eager_planned = False
        self.ahead = 0  # verifies that ran on a plan made ahead

    def prepare(self, positions: Tensor, layout: BatchLayout, key: object) -> None:
        """Plans ahead; the copies wait for the replay (see Staging)."""
        self._plan_graph(positions, layout, key)

    def plan(self, positions: Tensor, layout: BatchLayout) -> None:
        self._eager_planned = not self._plan_graph(positions, layout, None)
        if self._eager_planned:
            self.eager.plan(positions, layout)

    def _plan_graph(self, positions: Tensor, layout: BatchLayout, key: object) -> bool:
        """False when no graph fits (the verify runs eagerly)."""
        self._planned = None
        b, t = positions.shape
        bucket = bucket_of(b, self.buckets)
        if bucket is None:
            return False
        g = self.graphs[bucket]
        tg = g.inputs["tokens"].shape[1]
        cache = self.cache
        if t > tg or int(layout.starts.max()) + tg > cache.max_len:
            return False
        with self.capture.staging.deferred() if key is not None else nullcontext():
            g.attention[0].plan(pad_layout(layout, bucket, tg, cache.pad_slot))
            g.load("positions", pad2d(positions, bucket, tg))
        self._planned = (g, b, key)
        return True

    def padded(self, batch: int) -> int | None:
        return bucket_of(batch, self.buckets)

    def planned_for(self, key: object) -> bool:
        hit = self._planned is not None and self._planned[2] == key
        self.ahead += hit
        self._eager_planned &= not hit
        return hit

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Runs the planned graph on host `tokens` [B, T]: hidden [B, T, H], logits [B, T, V]."""
        self._ran = None
        if self._eager_planned:
            self._eager_planned = False
            out = self.eager.run(tokens)
            self.rows = self.eager.rows
            return out
        assert self._planned is not None, "run without a plan"
        g, b, _ = self._planned
        self._planned = None  # a plan serves one replay: the next verify plans afresh
        tg = g.inputs["tokens"].shape[1]
        g.load("tokens", pad2d(tokens, len(g.inputs["tokens"]), tg))
        self.capture.replay(g)
        self._ran = (len(g.inputs["tokens"]), b)
        self.rows = g.inputs["tokens"].numel()
        t = tokens.shape[1]
        return g.outputs["hidden"][:b, :t], g.outputs["logits"][:b, :t]

    def accept(self, batch: ChainBatch | TreeBatch) -> list[list[int]] | None:
        """The accept graph of the batch's bucket, on the verify's logits (see
        `VerifyStage.accept`)."""
        if self._ran is None:
            return None
        ran, b = self._ran[0], len(batch.u)
        bucket = bucket_of(b, self.buckets)
        assert bucket is not None  # the batch's rows lead those of the bucket that ran
        graph = self.accepts.get((bucket, batch.params.any_plain))
        if graph is None:
            return None
        if bucket != ran:
            # Riders' chunks (rows after the batch's: `TargetWorker.verify`) took the verify to
            # a larger bucket. The batch's rows move to the logits its own bucket's accept
            # graph reads: 8 requests and 14 chunks verify as 24 × 8 and accept as 8 × 8.
            logits = self.graphs[bucket].outputs["logits"]
            logits[:b].copy_(self.graphs[ran].outputs["logits"][:b])
        t = graph.inputs["u"].shape[1]
        if isinstance(batch, TreeBatch):
            return self._accept_trees(graph, batch, bucket, b, t)
        if batch.dense or batch.q_ids.shape[-1] > sampling.DRAFT_SUPPORT:
            return None
        n = batch.drafts.shape[1]  # the batch's longest chain, at most the tier's
        params = torch.ones(bucket, t, 5)
        params[:b, : n + 1] = batch.params.table.view(b, n + 1, 5)
        graph.load("params", params.view(bucket * t, 5))
        graph.load("drafts", pad2d(batch.drafts, bucket, t - 1))
        graph.load("lengths", pad2d(batch.lengths[:, None], bucket, 1)[:, 0])
        graph.load("u", pad2d(batch.u, bucket, t))
        ids = torch.zeros(bucket, t - 1, sampling.DRAFT_SUPPORT, dtype=torch.long)
        q = torch.zeros(bucket, t - 1, sampling.DRAFT_SUPPORT)
        k = batch.q_ids.shape[-1]
        ids[:b, :n, :k], q[:b, :n, :k] = batch.q_ids, batch.q
        graph.load("q_ids", ids)
        graph.load("q", q)
        self.capture.replay(graph)
        accepted, last, covered = graph.outputs["verdicts"][:, :b].tolist()
        if not all(covered):
            return None  # a row's cut lies past its candidates: it needs a sort
        self.graph_accepts += 1
        return [[m, token] for m, token in zip(accepted, last, strict=True)]

    def _accept_trees(
        self, graph: StageGraph, batch: TreeBatch, bucket: int, b: int, t: int
    ) -> list[list[int]] | None:
        n = batch.tokens.shape[1]  # the batch's widest tree, at most the shape's
        params = torch.ones(bucket, t, 5)
        params[:b, :n] = batch.params.table.view(b, n, 5)
        graph.load("params", params.view(bucket * t, 5))
        graph.load("tokens", pad2d(batch.tokens, bucket, t))
        parents = torch.full((bucket, t), -1, dtype=torch.long)
        parents[:b, :n] = batch.parents
        graph.load("parents", parents)
        graph.load("u", pad2d(batch.u, bucket, t))
        self.capture.replay(graph)
        last, covered, _, *accepted = graph.outputs["verdicts"][:, :b].tolist()
        if not all(covered):
            return None
        self.graph_accepts += 1
        return [
            [token, *(j for j in range(1, t) if accepted[j - 1][i])] for i, token in enumerate(last)
        ]

    def read_gpu_ms(self) -> float:
        return self.capture.read_gpu_ms()
