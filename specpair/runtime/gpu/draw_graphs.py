"""A sampled request's next token from its logits row in a CUDA graph: the joiners' first tokens
(a prefill's last rows, or riders' after the verify they rode in).

Eagerly the warp and the draw are some forty kernel launches and a host sync on whether each
row's cut lies among its candidates: 2.1-2.6 ms of an H200's host at 1 to 64 rows against their
microseconds of GPU work (`bench.gpu_kernels sampling`, `first token`), paid by every joining
round at T > 0. A graph per batch bucket replays `warp_candidates` and `sample_rows` over a
static copy of the rows' logits, for any mix of greedy, filtered and unfiltered rows (the flags
of `RowParams` set, so every path is in the graph; a row's probabilities are the same bits as
eagerly, whatever rows are beside it). A row whose cut lies past its candidates needs the sort
of `warp_rows`: the batch draws eagerly instead, from the same uniforms.

    3 rows → the graph of 4: logits [4, V] (row 3 stale, drawn and dropped), params [4, 5]
    (row 3 greedy), u [4] → `drawn` [2, 4]: tokens, covered
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpair.runtime.gpu.capture import GraphCapture, StageGraph, bucket_of
from specpair.runtime.sampling import RowParams, sample_rows, warp_candidates


def draw_graph(capture: GraphCapture, batch: int, vocab: int) -> StageGraph:
    """Static `logits` [batch, V] (float32), `params` [batch, 5] (`RowParams.table`; padding
    rows greedy) and uniforms `u` [batch] in; `drawn` [2, batch] out: each row's token and
    whether its warp held (its cut among its candidates)."""
    dev = capture.cache.device
    inputs = {
        "logits": torch.zeros(batch, vocab, device=dev),
        "params": torch.ones(batch, 5, device=dev),
        "u": torch.full((batch,), 0.5, device=dev),
    }

    def body() -> dict[str, Tensor]:
        params = RowParams(inputs["params"], True, True, True)
        probs, covered = warp_candidates(inputs["logits"], params)
        assert covered is not None
        return {"drawn": torch.stack([sample_rows(probs, inputs["u"]), covered.long()])}

    return capture.capture(body, inputs, [])


class DrawGraphs:
    """One draw graph per bucket of `capture`'s. They share its memory pool: a replay may
    overwrite the outputs of graphs captured after them (the tiers' verify graphs), so those
    are read first, as every stage reads its results before the next replay (a rider's first
    token is drawn once the verify's features are on the host). The prefill graphs, captured
    before them (`StateBuilder`), keep their features through a draw."""

    def __init__(self, capture: GraphCapture, vocab: int) -> None:
        self.capture = capture
        self.graphs = capture.timed(
            "draw", lambda: {b: draw_graph(capture, b, vocab) for b in capture.buckets}
        )
        self.replays = 0

    def run(self, logits: Tensor, params: RowParams, u: Tensor) -> list[int] | None:
        """Each row's token from logits [B, V] on the device, host `params` (B rows) and
        uniforms `u` [B]; None where no graph fits or a row's cut lies past its candidates."""
        b = len(logits)
        bucket = bucket_of(b, self.capture.buckets)
        if bucket is None:
            return None
        g = self.graphs[bucket]
        g.inputs["logits"][:b].copy_(logits)
        table = torch.ones(bucket, 5)
        table[:b] = params.table
        g.load("params", table)
        g.load("u", torch.nn.functional.pad(u.float(), (0, bucket - b), value=0.5))
        g.replay()  # not `capture.replay`: its timing is the verify's, read after the verify
        self.replays += 1
        tokens, covered = g.outputs["drawn"][:, :b].tolist()
        return tokens if all(covered) else None
