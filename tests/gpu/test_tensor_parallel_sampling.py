"""Speculative sampling at TP=2 on two GPUs matches the target's exact distribution (the joint of
3 sampled tokens of a 6-token vocabulary against transformers in bf16, chi-square, as
`test_cuda_sampling.py`), through the verify graphs whose all-reduces pair with the follower's;
a TP=2 target whose rank 0 drops the other rank's partial sums fails the same test."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip("flashinfer")

import specpair.runtime.gpu.fused as fused_module
from specpair.models import parallel
from specpair.models.tiny import make_tiny_llama
from specpair.parallel.build import build_parallel_states, build_parallel_target
from specpair.runtime.build import StateBuilder, build_drafter
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import tier_state
from tests.engine.test_sampling_lossless import PARAMS, fit_pvalue
from tests.gpu.test_cuda_sampling import DEPTH, PROMPT, RUNS, VOCAB, exact_joint

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
# heads and KV heads that split over two ranks
SHAPE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
TIER, BATCH = TreeShape(3), 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp_sampling")
    common = {"vocab_size": VOCAB, "tokenizer": False, "init_std": 0.3, **SHAPE}
    target = make_tiny_llama(root / "target", seed=21, num_layers=2, **common)  # type: ignore[arg-type]
    draft = make_tiny_llama(root / "draft", seed=22, num_layers=1, **common)  # type: ignore[arg-type]
    return target, draft


def tp2_samples(
    target: Path, draft: Path, params: SamplingParams, runs: int, broken: bool = False
) -> Counter:
    """Samples from a TP=2 pair built in a process of its own: NCCL's group, once joined, is
    left only with the process (`parallel/ranks.py`), and each test needs a group."""
    context = mp.get_context("spawn")
    answer, results = context.Pipe(duplex=False)  # a pipe's send is done when it returns
    child = context.Process(
        target=_sample_in_child, args=(target, draft, params, runs, broken, results)
    )
    child.start()
    results.close()
    try:
        if not answer.poll(CHILD_TIMEOUT_S):
            pytest.fail(f"no samples from the TP=2 process in {CHILD_TIMEOUT_S} s")
        counts = answer.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    if isinstance(counts, str):
        pytest.fail(counts)
    return Counter(counts)


CHILD_TIMEOUT_S = 600  # flashinfer's first compile on a fresh machine is in it


def _sample_in_child(
    target: Path, draft: Path, params: SamplingParams, runs: int, broken: bool, results: Any
) -> None:
    try:
        if broken:
            fused_module.reduce_sum = _own_part_only  # read as the graphs capture
        torch.cuda.set_device(0)
        worker, ranks = build_parallel_target(
            target, tensor_parallel=2, max_requests=BATCH, max_len=64, dtype=BF16, device="cuda:0"
        )
        results.send(dict(sample(worker, ranks.lockstep, draft, target, params, runs)))
    except BaseException as exc:
        results.send(f"{type(exc).__name__}: {exc}")
    sys.stdout.flush()
    os._exit(0)  # leaves NCCL's group with the process


def _own_part_only(x: Tensor) -> Tensor:
    """Rank 0 still takes part in each sum, through the same path as the follower's (which must
    not hang), but keeps its own partial: its layers see half of every attention and MLP
    output."""
    parallel.reduce_sum(x.clone())
    return x


def sample(worker, lockstep, draft: Path, target: Path, params: SamplingParams, runs: int):  # type: ignore[no-untyped-def]
    _, states = build_parallel_states(worker, lockstep, [TIER])
    drafter = build_drafter(
        draft, target_path=target, max_requests=BATCH, max_len=64, dtype=BF16, device="cuda:0"
    )
    drafts = StateBuilder(None, drafter).build_all([TIER])
    state = tier_state(TIER, states[TIER].verify, drafts[TIER].extend, drafts[TIER].draft)
    engine = SpeculativeEngine(worker, drafter)
    counts: Counter = Counter()
    for start in range(0, runs, BATCH):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i)
            for i in range(BATCH)
        ]
        results = engine.generate(
            [PROMPT] * BATCH, max_new_tokens=DEPTH, state=state, sampling=sampling
        )
        counts.update(tuple(r.token_ids) for r in results)
    assert state.verify.graph_accepts > 0  # type: ignore[union-attr]  # in the accept graph
    return counts


def test_tp2_speculative_sampling_matches_the_target_distribution(pair) -> None:
    counts = tp2_samples(*pair, PARAMS[0], RUNS)
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


def test_dropping_the_other_ranks_partial_sums_fails_the_same_test(pair) -> None:
    counts = tp2_samples(pair[0], pair[1], PARAMS[0], RUNS // 2, broken=True)
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) < 1e-6
