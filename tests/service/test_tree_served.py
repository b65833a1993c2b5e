"""Tree-shaped tiers over real gRPC: built at start-up beside the chains, applied between rounds
by ApplyTier's `shape`, drafted and verified as trees, reported in RoundStats and
GetServerInfo; greedy output equals target-only decoding through every switch, and a bad or
unknown shape is refused by name."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
import pytest

from specpair.proto.v1 import common_pb2, target_pb2
from specpair.runtime.build import StateBuilder, build_drafter, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from tests.service.conftest import draft_config, reference_greedy, target_config
from tests.service.test_tiers import no_slots_left, watch

STEPS = (1, 3, 7)
SHAPES = ("3x2x6", "4x4x16")
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
MAX_TOKENS = 24


async def tree_stack(
    ckpts: dict[str, Any], make_stack: Any, kind: str, draft: Any = None, **target: Any
) -> Any:
    draft = draft or (ckpts["eagle"] if kind == "eagle" else ckpts["draft"])
    return await make_stack(
        draft_config(
            draft,
            draft_kind=kind,
            target_path=ckpts["target"],
            candidate_steps=STEPS,
            tree_shapes=SHAPES,
        ),
        target_config(
            ckpts["target"], candidate_steps=STEPS, tree_shapes=SHAPES, max_batch=4, **target
        ),
    )


@pytest.mark.parametrize("kind", ["model", "eagle"])
async def test_a_tree_tier_serves_what_the_target_alone_would(ckpts, make_stack, kind) -> None:
    stack = await tree_stack(ckpts, make_stack, kind, initial_shape="4x4x16")
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert (info.speculative_num_steps, info.shape) == (4, "4x4x16")
    assert list(info.tree_shapes) == ["3x2x6", "4x4x16"] and list(info.candidate_steps) == [1, 3, 7]
    builds = info.runtime_state_builds
    rounds, task = await watch(stack)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS)
    )
    task.cancel()
    assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], PROMPTS, MAX_TOKENS)
    drafted = [r for r in rounds.values() if r.accept_lengths]
    assert drafted and {(r.speculative_num_steps, r.shape) for r in drafted} == {(4, "4x4x16")}
    assert all(0 <= a <= 4 for r in drafted for a in r.accept_lengths)
    assert any(a >= 1 for r in drafted for a in r.accept_lengths)  # trees were accepted
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert info.runtime_state_builds == builds  # nothing built after start-up
    await no_slots_left(stack)


async def test_sampled_requests_draft_trees_and_match_the_engine_seed_for_seed(
    ckpts, make_stack
) -> None:
    """A tree round's sampled trees carry no q (the target-only rule needs none): the target
    verifies them rather than refusing them as malformed, and a seeded request gives what the
    in-process engine gives at the same shape and seed. The draft is the target itself, so
    its trees are accepted often (the random pair accepts in ~1 % of sampled rounds)."""
    stack = await tree_stack(
        ckpts, make_stack, "model", draft=ckpts["target"], initial_shape="4x4x16"
    )
    rounds, task = await watch(stack)
    seeded = common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    outputs = await asyncio.gather(
        *(
            stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, sampling=seeded)
            for p in PROMPTS
        )
    )
    task.cancel()
    drafted = [r for r in rounds.values() if r.accept_lengths]
    assert drafted and all(r.shape == "4x4x16" for r in drafted)
    assert not any(r.plain_request_ids for r in drafted)  # no tree refused
    assert any(a >= 1 for r in drafted for a in r.accept_lengths)
    worker = build_target(ckpts["target"], max_requests=4, max_len=160, keep_features=True)
    drafter = build_drafter(
        ckpts["target"], target_path=ckpts["target"], max_requests=4, max_len=160
    )
    state = StateBuilder(worker, drafter).build(TreeShape(4, 4, 16))
    sampling = [SamplingParams(temperature=0.8, top_p=0.95, seed=11)] * len(PROMPTS)
    in_process = SpeculativeEngine(worker, drafter).generate(
        PROMPTS,
        max_new_tokens=MAX_TOKENS,
        state=state,
        sampling=sampling,
        stop_token_ids=frozenset({0}),
    )
    assert [t for t, _ in outputs] == [r.token_ids for r in in_process]
    await no_slots_left(stack)


async def test_switching_between_chains_and_trees_mid_generation(ckpts, make_stack) -> None:
    """3 → 4x4x16 → 7 → 3x2x6 while four requests decode: each round at the tier asked for,
    each output unchanged; the in-process engine at the tree shape agrees."""
    stack = await tree_stack(ckpts, make_stack, "eagle", initial_steps=3)
    rounds, task = await watch(stack)
    plan = [("", 4, "4x4x16"), ("", 7, ""), ("", 3, "3x2x6")]

    async def switch() -> None:
        for _, steps, shape in plan:
            # a few rounds at each tier, however fast the machine (a fixed sleep outlasted the
            # whole generation on a fast one)
            seen = len(rounds)
            while len(rounds) < seen + 3:
                await asyncio.sleep(0.002)
            answer = await stack.stub.ApplyTier(
                target_pb2.ApplyTierRequest(speculative_num_steps=steps, shape=shape)
            )
            assert (answer.speculative_num_steps, answer.shape) == (steps, shape)

    switching = asyncio.create_task(switch())
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=64) for p in PROMPTS)
    )
    await asyncio.wait_for(switching, 5)  # every switch landed while the requests decoded
    task.cancel()
    expected = reference_greedy(ckpts["target"], PROMPTS, 64)
    assert [t for t, _ in outputs] == expected
    seen = {(r.speculative_num_steps, r.shape) for r in rounds.values() if r.accept_lengths}
    assert (3, "") in seen and len(seen) >= 2  # started on the chain, switched at least once
    assert seen <= {(3, ""), (4, "4x4x16"), (7, ""), (3, "3x2x6")}
    await no_slots_left(stack)

    worker = build_target(ckpts["target"], max_requests=4, max_len=160, keep_features=True)
    drafter = build_drafter(
        ckpts["eagle"], target_path=ckpts["target"], max_requests=4, max_len=160
    )
    state = StateBuilder(worker, drafter).build(TreeShape(4, 4, 16))
    in_process = SpeculativeEngine(worker, drafter).generate(
        PROMPTS, max_new_tokens=64, state=state, stop_token_ids=frozenset({0})
    )
    assert [r.token_ids for r in in_process] == expected


@pytest.mark.parametrize(
    ("steps", "shape", "match"),
    [
        (0, "4x4", "speculative_num_steps: a tree shape is STEPSxTOPKxNUM_DRAFT_TOKENS"),
        (3, "4x4x16", "speculative_num_steps 3 disagrees with shape '4x4x16'"),
        (0, "4x4x8", r"speculative_num_steps 4x4x8 is not a candidate tier"),
        (5, "", r"speculative_num_steps 5 is not a candidate tier"),
    ],
)
async def test_a_bad_or_unbuilt_shape_is_refused_by_name(
    ckpts, make_stack, steps, shape, match
) -> None:
    stack = await tree_stack(ckpts, make_stack, "model")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(
            target_pb2.ApplyTierRequest(speculative_num_steps=steps, shape=shape)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() is not None
    assert re.search(match, err.value.details())
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], MAX_TOKENS)[0]


async def test_a_draft_without_the_shape_costs_only_speculation(ckpts, make_stack) -> None:
    """The target runs a tree shape its draft did not build: the draft refuses the round by
    name, the target decodes plainly, output unchanged."""
    stack = await make_stack(
        draft_config(ckpts["draft"], candidate_steps=STEPS),
        target_config(
            ckpts["target"], candidate_steps=STEPS, tree_shapes=SHAPES, initial_shape="3x2x6"
        ),
    )
    rounds, task = await watch(stack)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS)
    task.cancel()
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], MAX_TOKENS)[0]
    assert rounds and not any(r.accept_lengths for r in rounds.values())
