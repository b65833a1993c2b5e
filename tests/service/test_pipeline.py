"""Pipelined rounds over real gRPC: the draft pre-drafts while the target verifies.

Output is the target's own with hits, misses, tier switches, cancellations and a draft killed
mid-pipeline, for both draft kinds; RoundStats and GetServerInfo account for the pre-drafts;
every fork is freed. (On one CPU nothing overlaps: these tests are about the protocol.)
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from specpair.config import PipelineMode
from specpair.proto.v1 import common_pb2, target_pb2
from specpair.runtime.target.pipeline import PipelineChoice
from tests.service.conftest import draft_config, eventually, reference_greedy, target_config
from tests.service.test_tiers import generate_switching, watch

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
DRAFTS = {"model": "target", "eagle": "eagle", "unrelated": "draft"}  # kind → checkpoint


async def pipelined_stack(ckpts: dict[str, Any], make_stack: Any, draft: str, **target: Any):
    kind = "eagle" if draft == "eagle" else "model"
    return await make_stack(
        draft_config(ckpts[DRAFTS[draft]], draft_kind=kind, target_path=ckpts["target"],
                     max_requests=32, pipeline_width=8),
        target_config(ckpts["target"], pipeline=PipelineMode.ON, **target),
    )  # fmt: skip


async def nothing_left(stack: Any) -> None:
    """Every request and every fork freed on both services."""
    rounds = stack.draft.servicer.rounds
    # Both at once: the draft's compute thread releases a request (its id, then its slot)
    # while this loop looks, so one read between the two saw 31 free slots.
    await eventually(
        lambda: (
            rounds.active_requests == 0
            and rounds.drafter.cache.free_slots == 32
            and not rounds.pipeline.drafted
        )
    )
    scheduler = stack.target.servicer.scheduler
    assert scheduler.worker.cache.free_slots == len(scheduler.worker.cache.lengths)


@pytest.mark.parametrize("draft", ["model", "eagle", "unrelated"])
async def test_pipelined_rounds_are_lossless_and_accounted(ckpts, make_stack, draft) -> None:
    stack = await pipelined_stack(ckpts, make_stack, draft)
    rounds, watcher = await watch(stack)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=60) for p in PROMPTS)
    )
    assert [tokens for tokens, _ in outputs] == reference_greedy(ckpts["target"], PROMPTS, 60)
    await asyncio.sleep(0.2)
    watcher.cancel()
    stats = [r for r in rounds.values() if r.speculative]
    assert stats and all(r.pipelined for r in stats)
    assert all(len(r.predrafted) == len(r.accept_lengths) for r in stats)
    hits = sum(sum(r.predrafted) for r in stats)
    misses = sum(r.predraft_misses for r in stats)
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert info.pipeline
    if draft == "model":  # the draft is the target: nearly every outcome was pre-drafted
        assert hits > 4 * misses
        assert info.pipeline_hit_rate > 0.5
    # Each hit: the draft went on from the fork the target verified (none went unfound).
    pipeline = stack.draft.servicer.rounds.pipeline
    assert pipeline.hits == hits and pipeline.misses == 0
    assert hits + misses > 0
    await nothing_left(stack)


async def test_tier_switches_drop_predrafts_and_stay_lossless(ckpts, make_stack) -> None:
    stack = await pipelined_stack(ckpts, make_stack, "model", candidate_steps=(1, 3, 7))
    rounds, watcher = await watch(stack)
    tokens, _ = await generate_switching(
        stack, PROMPTS[1], 90, lambda n: {5: 7, 12: 1, 20: 3}.get(n)
    )
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 90)[0]
    await asyncio.sleep(0.2)
    watcher.cancel()
    ordered = [rounds[k] for k in sorted(rounds)]
    tiers = {r.speculative_num_steps for r in ordered}
    assert {1, 3, 7} <= tiers
    for before, after in itertools.pairwise(ordered):
        if before.speculative_num_steps != after.speculative_num_steps:
            assert not any(after.predrafted)  # made at the old tier: never used
    await nothing_left(stack)


async def test_cancelled_and_killed_draft_mid_pipeline_lose_nothing(ckpts, make_stack) -> None:
    stack = await pipelined_stack(ckpts, make_stack, "eagle")
    expected = reference_greedy(ckpts["target"], PROMPTS, 120)

    async def cancel_one() -> None:
        call = stack.stub.Generate(
            target_pb2.GenerateRequest(prompt_token_ids=PROMPTS[2], max_tokens=500)
        )
        async for _ in call:
            break
        call.cancel()

    async def kill_then_revive() -> None:
        await asyncio.sleep(0.3)
        await stack.stop_draft()
        await asyncio.sleep(0.4)
        await stack.restart_draft()

    chaos = asyncio.gather(cancel_one(), kill_then_revive())
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=120) for p in PROMPTS)
    )
    await chaos
    assert [tokens for tokens, _ in outputs] == expected
    await stack.wait_draft_connected()
    tokens, responses = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=30)
    assert tokens == expected[0][:30]
    assert responses[-1].speculation.rounds > responses[-1].speculation.plain_rounds
    await nothing_left(stack)


async def test_a_draft_that_does_not_pipeline_serves_plain_rounds(ckpts, make_stack) -> None:
    stack = await make_stack(
        draft_config(ckpts["target"], pipeline=PipelineMode.OFF),
        target_config(ckpts["target"], pipeline=PipelineMode.ON),
    )
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=30)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 30)[0]
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert not info.pipeline


async def test_a_pipelining_draft_drafts_ahead_only_for_targets_that_ask(
    ckpts, make_stack, monkeypatch
) -> None:
    """A round the target does not pipeline gets plain chains: no lookahead step (the draft
    pipelines by default, while a target on its GPU does not ask)."""
    stack = await make_stack(
        draft_config(ckpts["target"], max_requests=32, pipeline_width=8),
        target_config(ckpts["target"], pipeline=PipelineMode.OFF),
    )
    rounds = stack.draft.servicer.rounds
    assert rounds.pipeline is not None
    ahead: list[int] = []
    real = rounds.drafter.draft_ahead
    monkeypatch.setattr(rounds.drafter, "draft_ahead", lambda *a: ahead.append(1) or real(*a))
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=5)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=30)
    await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=30, sampling=sampling)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 30)[0]
    assert not ahead


async def test_auto_pipelines_only_across_devices(ckpts, make_stack) -> None:
    stack = await pipelined_stack(ckpts, make_stack, "model")
    scheduler = stack.target.servicer.scheduler
    scheduler.pipeline = PipelineMode.AUTO
    assert not scheduler.pipelining  # both on the CPU
    scheduler.draft.links[0].draft_device = "cuda:1"
    assert scheduler.pipelining


async def test_auto_across_devices_measures_both_ways_in_blocks_and_stays_lossless(
    ckpts, make_stack, monkeypatch
) -> None:
    """Under auto with the draft on another device, rounds go out sequential, then pipelined,
    a probe of each, then the faster way; switching between them mid-request loses nothing."""
    monkeypatch.setattr(PipelineChoice, "PROBE", 3)
    monkeypatch.setattr(PipelineChoice, "EXPLOIT", 4)
    stack = await pipelined_stack(ckpts, make_stack, "model")
    scheduler = stack.target.servicer.scheduler
    scheduler.pipeline = PipelineMode.AUTO
    scheduler.draft.links[0].draft_device = "cuda:1"
    rounds, watcher = await watch(stack)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=90)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 90)[0]
    await asyncio.sleep(0.2)
    watcher.cancel()
    modes = [r.pipelined for _, r in sorted(rounds.items()) if r.speculative]
    assert modes[:6] == [False] * 3 + [True] * 3
    assert len(modes) > 10 and modes[6:10] in ([True] * 4, [False] * 4)  # the winner's block
    seq, piped = scheduler.round.predrafts.choice.rates(3, 1)
    assert seq > 0 and piped > 0
    await nothing_left(stack)
