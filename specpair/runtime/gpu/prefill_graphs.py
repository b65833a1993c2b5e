"""The target's prefill in CUDA graphs, for the small batches of prompts that join a batch.

Eagerly a prefill is host-bound while its prompts are few: on an H100 the grown 8B target's
prefill of one 128-token prompt took 19.2 ms to enqueue (some 500 kernel launches, 32 layers of
Python) for 7.4 ms of GPU work, and of eight prompts 36 ms; requests leaving a drafted batch of
64 one or two a round paid that in every round (`gpu_kernels prefill`). A graph per (batch,
tokens) bucket replays the same forward over static buffers: prompts padded to the bucket
(padding rows and columns see only themselves, as in the verify's graphs), the logits of each
prompt's last row and the features (EAGLE) of every row out. Prompts past the largest bucket,
or more of them than `MOST_ROWS` rows, keep the eager forward: there the GPU's work hides the
launches.

    2 prompts of 100 and 120 tokens → bucket (2, 128): tokens [2, 128], last = [99, 119]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.models.llama import LlamaModel
from specpair.runtime.gpu.capture import GraphCapture, StageGraph, pad2d, pad_layout
from specpair.runtime.layout import BatchLayout

TOKENS = (128, 256, 512)  # the buckets of prompt length
# batch × tokens of the largest graph: past it the GPU's work hides the launches (H100, 8B: 8
# prompts of 128 tokens 29.4 ms graphed, 32.3 eager), and each graph's buffers cost memory
MOST_ROWS = 1024
MOST_PROMPTS = 8


def prefill_graph(
    capture: GraphCapture,
    model: LlamaModel,
    batch: int,
    tokens: int,
    feature_layers: tuple[int, ...],
) -> StageGraph:
    """Static `tokens` [batch, tokens] and `last` [batch] (each prompt's last row) in; out
    `features` [batch, tokens, F] (`LlamaModel.forward_aux`) and the last rows' `logits`
    [batch, V]. Every prompt starts at position 0, so the positions are fixed in the graph."""
    dev = capture.cache.device
    inputs = {
        "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        "positions": torch.arange(tokens, device=dev).expand(batch, tokens).contiguous(),
        "last": torch.zeros(batch, dtype=torch.long, device=dev),
    }
    attn = capture.attention(batch, tokens)
    rows = torch.arange(batch, device=dev)

    def body() -> dict[str, Tensor]:
        hidden, features = model.forward_aux(
            inputs["tokens"], inputs["positions"], attn.attend, feature_layers
        )
        return {"features": features, "logits": model.logits(hidden[rows, inputs["last"]])}

    return capture.capture(body, inputs, [attn])


class PrefillGraphs:
    """One graph per (batch, tokens) bucket: batch a bucket of `capture`'s up to MOST_PROMPTS,
    tokens one of TOKENS within the cache, batch × tokens at most MOST_ROWS. Their attention is
    flashinfer's (`Backends.flashinfer_serves`): TOKENS rows are past the Triton tree kernel's."""

    def __init__(
        self, capture: GraphCapture, model: LlamaModel, feature_layers: tuple[int, ...]
    ) -> None:
        self.capture = capture
        cache = capture.cache
        keys = [
            (b, t)
            for b in capture.buckets
            if b <= MOST_PROMPTS
            for t in TOKENS
            if t <= cache.max_len and b * t <= MOST_ROWS
        ]
        self.graphs = capture.timed(
            "prefill", lambda: {k: prefill_graph(capture, model, *k, feature_layers) for k in keys}
        )
        self.replays = 0

    def bucket(self, batch: int, tokens: int) -> tuple[int, int] | None:
        """The smallest graph that holds `batch` prompts of up to `tokens`; None if none."""
        fits = [k for k in self.graphs if k[0] >= batch and k[1] >= tokens]
        return min(fits, key=lambda k: (k[0] * k[1], k[1]), default=None)

    @property
    def longest(self) -> int:
        """The longest prompt a graph takes: one past it runs eagerly."""
        return max((t for _, t in self.graphs), default=0)

    def run(
        self, layout: BatchLayout, tokens: Tensor, lengths: Sequence[int]
    ) -> tuple[Tensor, Tensor] | None:
        """Features [B', T', F] and last rows' logits [B', V] (the graph's buffers: read before
        the next replay) of prompts `tokens` [B, T] on the host; None where no graph fits."""
        b, t = tokens.shape
        key = self.bucket(b, t)
        if key is None:
            return None
        g = self.graphs[key]
        g.attention[0].plan(pad_layout(layout, *key, self.capture.cache.pad_slot))
        g.load("tokens", pad2d(tokens, *key))
        last = torch.zeros(key[0], dtype=torch.long)
        last[:b] = torch.tensor(lengths) - 1
        g.load("last", last)
        # Not `capture.replay`: its timing is the verify's, read after the round's verify.
        g.replay()
        self.replays += 1
        return g.outputs["features"], g.outputs["logits"]
