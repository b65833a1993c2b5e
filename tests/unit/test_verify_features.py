"""A batched verify hands each request the features of its own committed positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_target
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.worker import TargetSequence, kept_rows
from specpair.runtime.tree import chain

PROMPTS = [[5, 6, 7], [10, 11, 12, 13], [3, 9]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("features") / "target", seed=4)


def verified(target: Path, group: list[int], sampling: SamplingParams) -> list[torch.Tensor]:
    worker = build_target(target, max_requests=len(PROMPTS), max_len=64, keep_features=True)
    seqs = [TargetSequence(f"r{i}", PROMPTS[i], sampling, max_new_tokens=8) for i in group]
    worker.prefill(seqs)
    trees = [chain([20 + i, 30 + i]) for i in group]
    if not sampling.greedy:  # a q that gives the drafted tokens mass
        trees = [chain(t.tokens, torch.full((2, 320), 1 / 320)) for t in trees]
    return [r.features for r in worker.verify(seqs, trees)]  # type: ignore[misc]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=1)])
def test_each_request_gets_its_own_rows_features(target: Path, sampling: SamplingParams) -> None:
    together = verified(target, [0, 1, 2], sampling)
    for i, feats in enumerate(together):
        alone = verified(target, [i], sampling)[0]
        assert feats.shape == alone.shape
        torch.testing.assert_close(feats, alone, atol=1e-5, rtol=1e-4)


def test_kept_rows_reads_each_requests_rows_in_one_copy() -> None:
    """The batched read of the accepted rows equals indexing request by request, for paths of
    different lengths (a chain accepting all, one accepting none, a tree's branch)."""
    hidden = torch.randn(3, 5, 7)
    keeps = [[0, 1, 2, 3, 4], [0], [0, 2, 4]]
    rows = kept_rows(hidden, keeps)
    assert [r.shape for r in rows] == [(5, 7), (1, 7), (3, 7)]
    for b, keep in enumerate(keeps):
        assert torch.equal(rows[b], hidden[b, keep])
