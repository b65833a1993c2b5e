"""The verify stage in CUDA graphs: B × (s + 1) tree tokens → hidden [B, s + 1, H], logits.

One graph per batch bucket of a tier; a verify that no graph fits (a batch past the largest
bucket, a tree past the cache's end) runs the eager stage instead.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from specpair.models.llama import LlamaModel
from specpair.runtime.graphs.capture import GraphCapture, StageGraph, bucket_of, pad2d, pad_layout
from specpair.runtime.layout import BatchLayout
from specpair.runtime.stages import EagerVerify


def verify_graph(capture: GraphCapture, model: LlamaModel, batch: int, tokens: int) -> StageGraph:
    """The graph of one bucket: static tokens and positions [batch, tokens] in."""
    dev = capture.cache.device
    inputs = {
        "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        "positions": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
    }
    attn = capture.attention(batch, tokens)

    def body() -> dict[str, Tensor]:
        hidden = model(inputs["tokens"], inputs["positions"], attn.attend)
        return {"hidden": hidden, "logits": model.logits(hidden)}

    return capture.capture(body, inputs, [attn])


class VerifyGraphs:
    """One tier's verify stage. `plan` picks the bucket graph, plans its attention and loads
    the positions; `run` loads the tokens and replays it. A plan made ahead (`prepare`) carries
    a `key` (what it depends on) and serves the one verify whose key matches."""

    plans_ahead = True

    def __init__(self, capture: GraphCapture, model: LlamaModel, tier: int) -> None:
        self.capture, self.cache = capture, capture.cache
        self.eager = EagerVerify(model, capture.cache)
        self.graphs = capture.timed(
            tier, lambda: {b: verify_graph(capture, model, b, tier + 1) for b in capture.buckets}
        )
        self._planned: tuple[StageGraph, int, object] | None = None  # graph, batch, key
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
        bucket = bucket_of(b, self.capture.buckets)
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

    def planned_for(self, key: object) -> bool:
        hit = self._planned is not None and self._planned[2] == key
        self.ahead += hit
        self._eager_planned &= not hit
        return hit

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Runs the planned graph on host `tokens` [B, T]: hidden [B, T, H], logits [B, T, V]."""
        if self._eager_planned:
            self._eager_planned = False
            return self.eager.run(tokens)
        assert self._planned is not None, "run without a plan"
        g, b, _ = self._planned
        self._planned = None  # a plan serves one replay: the next verify plans afresh
        tg = g.inputs["tokens"].shape[1]
        g.load("tokens", pad2d(tokens, len(g.inputs["tokens"]), tg))
        self.capture.replay(g)
        t = tokens.shape[1]
        return g.outputs["hidden"][:b, :t], g.outputs["logits"][:b, :t]

    def read_gpu_ms(self) -> float:
        return self.capture.read_gpu_ms()
