"""Joining requests whose prompts ride in a verify (`TargetWorker.verify`'s riders): the same
KV, first token and features as a prefill of their own, and the batch's verify unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_states, build_target
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE, CandidateTree, chain, full_parents

RUNNING = [[5, 6, 7], [10, 11, 12, 13, 14]]
# at tier 3 (chunks of 4): a partial last chunk, one shorter than a chunk, whole chunks
RIDERS = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [60, 61, 62], [70, 71, 72, 73, 74, 75, 76, 77]]
TIER = 3
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, seed=7)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("riders") / "target", seed=4)


def setup(
    target: Path, sampling: SamplingParams
) -> tuple[TargetWorker, SpecRuntimeState, list[TargetSequence], list[TargetSequence]]:
    worker = build_target(target, max_requests=8, max_len=64, keep_features=True)
    state = build_states([TIER], worker)[TIER]
    worker.ride_rows = 1 << 10
    seqs = [TargetSequence(f"r{i}", p, sampling, max_new_tokens=32) for i, p in enumerate(RUNNING)]
    worker.prefill(seqs)
    riders = [TargetSequence(f"j{i}", p, sampling, 32) for i, p in enumerate(RIDERS)]
    return worker, state, seqs, riders


def trees(seqs: list[TargetSequence], sampling: SamplingParams) -> list[CandidateTree]:
    out = [chain([20 + i, 30 + i, 21 + i]) for i in range(len(seqs))]
    if not sampling.greedy:  # a q that gives the drafted tokens mass
        out = [chain(t.tokens, torch.full((3, 320), 1 / 320)) for t in out]
    return out


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_riders_get_what_a_prefill_of_their_own_gives(
    target: Path, sampling: SamplingParams
) -> None:
    apart, state, seqs_a, riders_a = setup(target, sampling)
    riding, state_b, seqs_b, riders_b = setup(target, sampling)

    results_a = apart.verify(seqs_a, trees(seqs_a, sampling), state)
    feats_a = apart.prefill(riders_a)
    for seq in riders_b:
        seq.slot = riding.cache.alloc()
    results_b = riding.verify(seqs_b, trees(seqs_b, sampling), state_b, riders_b)

    for a, b in zip(results_a, results_b, strict=True):
        assert a.new_tokens == b.new_tokens
        assert a.acceptance == b.acceptance
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-4)
    assert [s.output for s in riders_a] == [s.output for s in riders_b]
    for i, (a, b) in enumerate(zip(riders_a, riders_b, strict=True)):
        assert riding.cache.lengths[b.slot] == len(RIDERS[i]) == b.committed
        f = riding.rode[i]
        assert f is not None and f.shape == (len(RIDERS[i]), f.shape[1])
        torch.testing.assert_close(f, feats_a[i], atol=1e-5, rtol=1e-4)
        for layer in (0, 1):
            ka, va = apart.cache.read(layer, a.slot, len(RIDERS[i]))
            kb, vb = riding.cache.read(layer, b.slot, len(RIDERS[i]))
            torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-4)
    # the riders then decode with the batch as prefilled requests do
    for worker, seqs, riders, st in (
        (apart, seqs_a, riders_a, state),
        (riding, seqs_b, riders_b, state_b),
    ):
        worker.verify(seqs + riders, [EMPTY_TREE] * 5, st)
    assert [s.output for s in seqs_a + riders_a] == [s.output for s in seqs_b + riders_b]


def test_a_planned_verify_with_riders_is_the_one_that_runs(target: Path) -> None:
    """`prepare` plans the rows `verify` builds (riders' chunks included): the plan's key
    matches, so an ahead-planning stage runs the verify on it."""
    worker, state, seqs, riders = setup(target, SamplingParams())
    for seq in riders:
        seq.slot = worker.cache.alloc()
    parents = [list(state.chain_parents)] * len(seqs)
    planned = worker._plan_key(worker._rows(seqs, parents, riders, state))
    full = [chain([1, 2, 3])] * len(seqs)
    verified = worker._plan_key(worker._rows(seqs, [full_parents(t) for t in full], riders, state))
    assert planned == verified
    rows = worker._rows(seqs, parents, riders, state)
    # 10 → chunks of 4, 4, 2; 3 → one of 3; 8 → 4, 4: each from its own start
    assert [(start, len(par)) for _, start, par in rows[2:]] == [
        (0, 4),
        (4, 4),
        (8, 2),
        (0, 3),
        (0, 4),
        (4, 4),
    ]


def test_rides_only_within_the_rows_and_a_chain_tier(target: Path) -> None:
    worker, state, _, _ = setup(target, SamplingParams())
    worker.ride_rows = 0
    assert not worker.rides(state, 2, [10])
    worker.ride_rows = 3 * 4  # a 10-token prompt's 3 chunks of 4 rows (eager: no padding)
    assert worker.rides(state, 2, [10])
    assert not worker.rides(state, 2, [13])  # 4 chunks
    assert not worker.rides(None, 2, [10])  # plain decoding: no tier's chain
    assert not worker.rides(state, 2, [64 - 3])  # its last chunk would pass max_len
    worker.deterministic = True  # the batch-invariant mode prefills a prompt alone
    assert not worker.rides(state, 2, [10])


def test_riders_leave_pages_for_the_prompts_prefilled_beside_them(target: Path) -> None:
    """A verify that finds no page fails its whole batch: a prompt rides only where the pages
    left hold its chunks, the batch's trees and the prompts prefilled before the verify."""
    worker, state, _, _ = setup(target, SamplingParams())
    pool = worker.cache.pages
    pool.free = pool.free[:4]  # 4 pages of 16 positions left
    assert not worker.rides(state, 2, [10])  # 1 page for the prompt, 2 × 2 for the trees: 5
    pool.free = list(range(5))  # 5 pages
    assert worker.rides(state, 2, [10])
    assert not worker.rides(state, 2, [10], beside=[20])  # and 2 for a 20-token prefill
