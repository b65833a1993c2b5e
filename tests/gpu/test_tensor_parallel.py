"""A tensor-parallel target on two GPUs (NCCL; rank 0 here on cuda:0, its follower on cuda:1):
the fused layers all-reduce inside the CUDA graphs of every tier, tree shape, batch bucket and
the prefill, and the follower replays rank 0's graphs from one step message a replay.

Greedy, against the shipped pair (bf16): TP=2's target alone gives TP=1's greedy tokens, and
speculation at TP=2 (the EAGLE-3 head and the draft LM, chains 1/3/7 and a tree) gives TP=2's
own greedy tokens, each up to the GPU tie rule (`test_cuda_runtime.check_greedy`); nothing is
captured after start-up. The sampled distribution test at TP=2 is in
`test_tensor_parallel_sampling.py`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip("flashinfer")

from specpair.config import MODELS_DIR
from specpair.parallel.build import build_parallel_states, build_parallel_target
from specpair.runtime.build import StateBuilder, build_drafter, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.gpu.verify_graphs import VerifyGraphs
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState, tier_state
from specpair.runtime.target.worker import TargetWorker
from tests.gpu.test_cuda_runtime import PROMPTS, check_greedy

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
TIERS = [TreeShape(0), TreeShape(1), TreeShape(3), TreeShape(7), TreeShape(3, 2, 4)]
TARGET = MODELS_DIR / "target"
NEW_TOKENS = 32


def build(tp: int, draft: Path) -> tuple[TargetWorker, Any]:
    gc.collect()
    torch.cuda.set_device(0)  # rank 0's, as the target service binds it
    options = dict(
        max_requests=4,
        max_len=256,
        keep_features=True,
        dtype=BF16,
        device="cuda:0",
        feature_layers=feature_layers(draft, TARGET),
    )
    if tp == 1:
        return build_target(TARGET, **options), None  # type: ignore[arg-type]
    return build_parallel_target(TARGET, tensor_parallel=tp, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tp2() -> Iterator[list]:
    """[worker, ranks, builder, states]; emptied before the group is left (NCCL's waits for
    every graph that captured its collectives to be freed: `RankGroup.stop`)."""
    worker, ranks = build(2, MODELS_DIR / "eagle3")
    assert ranks is not None
    built: list = [worker, ranks]
    del worker
    try:
        built += build_parallel_states(built[0], ranks.lockstep, TIERS)
        yield built
    finally:
        built.clear()
        ranks.stop(leave=True)


def with_draft(states: dict, draft: Path) -> tuple[object, dict[TreeShape, SpecRuntimeState]]:
    """The target's states joined with a drafter's (on rank 0's GPU), tier by tier."""
    drafter = build_drafter(
        draft, target_path=TARGET, max_requests=4, max_len=256, dtype=BF16, device="cuda:0"
    )
    drafts = StateBuilder(None, drafter).build_all(TIERS)
    joined = {
        tier: tier_state(tier, states[tier].verify, drafts[tier].extend, drafts[tier].draft)
        for tier in TIERS
    }
    return drafter, joined


def test_the_graphs_that_all_reduce_are_the_verify_and_prefill_graphs(tp2) -> None:
    worker, _, builder, states = tp2
    graphs = builder.target_graphs.graphs
    collective = [g for g in graphs if g.collective]
    verify = {id(g) for st in states.values() for g in st.verify.graphs.values()}
    # (none for the shipped target: its head_dim 40 is not flashinfer's, whose prefill they run)
    graphed = worker.prefill_graphs
    prefill = set() if graphed is None else {id(g) for g in graphed.graphs.values()}
    assert {id(g) for g in collective} == verify | prefill
    assert all(g.mirror is not None for g in collective)
    assert all(g.mirror is None for g in graphs if not g.collective)  # accepts: rank 0's alone
    assert all(isinstance(st.verify, VerifyGraphs) for st in states.values())


def test_tp2_target_alone_gives_tp1s_greedy_tokens(tp2) -> None:
    worker, ranks, builder, states = tp2
    tp1, _ = build(1, MODELS_DIR / "eagle3")
    sent, captures = ranks.lockstep.sent, builder.captures
    for state in (None, states[TreeShape(0)]):  # plain decoding eagerly, and tier 0's graphs
        plain2 = SpeculativeEngine(worker, None).generate(
            PROMPTS, max_new_tokens=NEW_TOKENS, state=state
        )
        plain1 = SpeculativeEngine(tp1, None).generate(
            PROMPTS, max_new_tokens=NEW_TOKENS, state=None
        )
        identical, total, _ = check_greedy(tp1, plain2, plain1, "TP=2 alone against TP=1")
        assert identical >= total // 2
    assert ranks.lockstep.sent > sent  # the follower computed its half of every forward
    assert builder.captures == captures, "captured after start-up"


@pytest.mark.parametrize("draft", ["eagle3", "draft"])
def test_speculation_at_tp2_gives_tp2s_greedy_tokens(tp2, draft: str) -> None:
    worker, _, builder, states = tp2
    drafter, joined = with_draft(states, MODELS_DIR / draft)
    captures = builder.captures
    plain = SpeculativeEngine(worker, None).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, state=joined[TreeShape(0)]
    )
    accepted = 0
    for tier in (TreeShape(3), TreeShape(1), TreeShape(7), TreeShape(3, 2, 4), TreeShape(3)):
        engine = SpeculativeEngine(worker, drafter)  # type: ignore[arg-type]
        spec = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, state=joined[tier])
        check_greedy(worker, spec, plain, f"[{draft}] TP=2 tier {tier}")
        accepted += sum(max(a, 0) for r in spec for a in r.accept_lengths)
    assert accepted > 0, "nothing was accepted: speculation did not run"
    assert builder.captures == captures, "captured after start-up"
