"""The seam between the target's prefill and its CUDA graphs (`gpu/prefill_graphs.py`), on the
CPU: a graph's outputs are padded to its bucket, and the worker reads only the real rows.

The stand-in graph computes the eager forward and pads it the way a graph's buffers are
padded, with padding rows that would win every argmax and draw if they were read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_target
from specpair.runtime.layout import BatchLayout
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.worker import TargetSequence, TargetWorker

PROMPTS = [[5, 6, 7], list(range(10, 40)), [3]]
BUCKET = (4, 64)  # 3 prompts of up to 30 tokens, padded as a graph of 4 x 64 pads them


class PaddedGraphs:
    """The eager forward, padded to BUCKET: padding rows of huge logits and features."""

    def __init__(self, worker: TargetWorker) -> None:
        self.worker, self.replays = worker, 0

    def run(
        self, layout: BatchLayout, tokens: Tensor, lengths: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        b, t = tokens.shape
        hidden, feats = self.worker._forward(tokens, torch.arange(t).expand(b, t), layout)
        logits = self.worker.model.logits(hidden[torch.arange(b), torch.tensor(lengths) - 1])
        padded_feats = torch.full((*BUCKET, feats.shape[-1]), 1e4)
        padded_feats[:b, :t] = feats
        padded_logits = torch.full((BUCKET[0], logits.shape[-1]), 1e4)
        padded_logits[:b] = logits
        self.replays += 1
        return padded_feats, padded_logits


def prefill(worker: TargetWorker, sampling: SamplingParams) -> list[tuple[int, Tensor]]:
    seqs = [TargetSequence(f"r{i}", p, sampling, 4) for i, p in enumerate(PROMPTS)]
    features = worker.prefill(seqs)
    for seq in seqs:
        worker.release(seq)
    return [(s.output[0], f) for s, f in zip(seqs, features, strict=True) if f is not None]


def test_a_graph_padded_to_its_bucket_gives_the_eager_prefill(tmp_path: Path) -> None:
    worker = build_target(
        make_tiny_llama(tmp_path / "t", seed=3), max_requests=4, max_len=96, keep_features=True
    )
    graphs = PaddedGraphs(worker)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=7)):
        eager = prefill(worker, sampling)
        worker.prefill_graphs = graphs  # type: ignore[assignment]
        graphed = prefill(worker, sampling)
        worker.prefill_graphs = None
        assert len(graphed) == len(PROMPTS)
        for (token, feats), (want_token, want_feats), prompt in zip(
            graphed, eager, PROMPTS, strict=True
        ):
            assert token == want_token
            assert feats.shape == (len(prompt), want_feats.shape[-1])
            torch.testing.assert_close(feats, want_feats)
    assert graphs.replays == 2
