"""Tier 0 and per-request tiers over real gRPC: output unchanged, the draft skipped at tier 0
and caught up after, RoundStats per request, no slot left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from specpair.proto.v1 import target_pb2
from tests.service.conftest import draft_config, eventually, reference_greedy, target_config

STEPS = (0, 1, 3, 7)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]


async def tier_stack(ckpts: dict[str, Any], make_stack: Any, kind: str) -> Any:
    draft = ckpts["eagle"] if kind == "eagle" else ckpts["target"]
    stack = await make_stack(
        draft_config(draft, draft_kind=kind, target_path=ckpts["target"], candidate_steps=STEPS),
        target_config(ckpts["target"], candidate_steps=STEPS),
    )
    rounds = stack.draft.servicer.rounds
    run = rounds.run
    stack.draft_rounds = []  # (round id, input count) of every round the draft served

    def counted(stream_id: str, wire: Any) -> Any:  # a WireRound (`read_round`)
        stack.draft_rounds.append((wire.message.round_id, len(wire.message.inputs)))
        return run(stream_id, wire)

    rounds.run = counted
    return stack


async def watch(stack: Any) -> tuple[dict[int, target_pb2.RoundStats], asyncio.Task[None]]:
    rounds: dict[int, target_pb2.RoundStats] = {}

    async def follow() -> None:
        async for update in stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()):
            rounds[update.round.round_id] = update.round

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)  # open before the first round
    return rounds, task


async def no_slots_left(stack: Any) -> None:
    """Everything freed on both services, and no round fell back (a tier-0 round is no
    fallback; a draft that failed to catch up would have answered an error)."""
    scheduler = stack.target.servicer.scheduler
    fallbacks = scheduler.metrics.fallback_rounds.collect()[0].samples
    assert [s for s in fallbacks if s.value] == []
    await eventually(lambda: stack.draft.servicer.rounds.active_requests == 0)
    assert scheduler.worker.cache.free_slots == len(scheduler.worker.cache.lengths)
    assert not scheduler.session.views and not scheduler.tiers.own


async def generate_switching(
    stack: Any, prompt: list[int], max_tokens: int, switch: Callable[[int], int | None], **kw: Any
) -> tuple[list[int], list[target_pb2.GenerateResponse]]:
    """Generates, and after the n-th response asks for tier `switch(n)` (None: no change)."""
    tokens: list[int] = []
    responses = []
    request = target_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, **kw)
    async for r in stack.stub.Generate(request):
        tokens += r.token_ids
        responses.append(r)
        tier = switch(len(responses))
        if tier is not None:
            await stack.stub.ApplyTier(target_pb2.ApplyTierRequest(speculative_num_steps=tier))
    return tokens, responses


def three_zero_three(n: int) -> int | None:
    return {4: 0, 14: 3}.get(n)


@pytest.mark.parametrize("kind", ["model", "eagle"])
async def test_tier_zero_and_back_is_lossless_and_skips_the_draft(
    ckpts, make_stack, kind: str
) -> None:
    stack = await tier_stack(ckpts, make_stack, kind)
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert tuple(info.candidate_steps) == STEPS
    rounds, watcher = await watch(stack)
    tokens, responses = await generate_switching(stack, PROMPTS[1], 90, three_zero_three)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 90)[0]
    await eventually(lambda: max(rounds, default=0) >= max(stack.draft_rounds)[0])
    watcher.cancel()
    by_tier = [r.speculative_num_steps for r in responses[1:]]  # [0] is the prefill
    zero = [i for i, t in enumerate(by_tier) if t == 0]
    assert len(zero) >= 8 and 3 in by_tier[zero[-1] :]  # it went to 0 and came back
    zero_rounds = [s for s in rounds.values() if s.speculative_num_steps == 0]
    assert len(zero_rounds) >= 8
    for s in zero_rounds:
        assert not s.speculative and not s.accept_lengths and not s.request_ids
        assert s.timings.total_ms > 0 and s.timings.verify_ms > 0 and s.timings.draft_ms == 0
        assert list(s.plain_request_ids) == [s.plain_request_ids[0]]
    drafted = {round_id for round_id, _ in stack.draft_rounds}
    assert not drafted & {s.round_id for s in zero_rounds}  # the draft was never called
    resumed = [s for s in rounds.values() if s.speculative_num_steps == 3 and s.speculative]
    assert all(s.timings.extend_ms > 0 for s in resumed)
    if kind == "model":  # the draft is the target: caught up, it drafts exactly the target's
        later = [s for s in resumed if s.round_id > zero_rounds[-1].round_id]
        assert later and all(list(s.accept_lengths) == [3] for s in later[:-1])
    await no_slots_left(stack)


@pytest.mark.parametrize("kind", ["model", "eagle"])
async def test_mixed_request_tiers_in_one_batch_are_lossless(ckpts, make_stack, kind) -> None:
    """Four requests at once, each at its own tier (0, 1, 3, 7) and then switched around;
    every output is the target's own, every RoundStats names each request's tier."""
    stack = await tier_stack(ckpts, make_stack, kind)
    scheduler = stack.target.servicer.scheduler
    rounds, watcher = await watch(stack)
    ids: dict[str, int] = {}  # internal request id → tier asked for it

    async def steer() -> None:
        for shift in range(40):
            await asyncio.sleep(0.03)
            live = [r.seq.request_id for r in scheduler.running]
            ids.update({rid: STEPS[(i + shift // 10) % 4] for i, rid in enumerate(sorted(live))})
            request = target_pb2.ApplyTierRequest(
                speculative_num_steps=3, request_steps={r: ids[r] for r in live}
            )
            await stack.stub.ApplyTier(request)

    steering = asyncio.create_task(steer())
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=60) for p in PROMPTS)
    )
    steering.cancel()
    assert [tokens for tokens, _ in outputs] == reference_greedy(ckpts["target"], PROMPTS, 60)
    await asyncio.sleep(0.2)
    watcher.cancel()
    mixed = [s for s in rounds.values() if len(set(s.request_steps)) > 1]
    assert mixed, "no round ran requests at different tiers"
    for s in rounds.values():
        assert len(s.request_ids) == len(s.request_steps) == len(s.accept_lengths)
        assert len(s.request_ids) + len(s.plain_request_ids) == s.batch_size
        if s.request_steps:
            assert s.speculative_num_steps == max(s.request_steps)  # the round's state
        for steps, accepted in zip(s.request_steps, s.accept_lengths, strict=True):
            assert 0 <= accepted <= steps and steps >= 1
    for _, responses in outputs:
        for r in responses[1:]:
            assert r.accept_length <= r.speculative_num_steps
            assert r.speculative_num_steps > 0 or r.accept_length == -1
    await no_slots_left(stack)


async def test_request_tiers_are_checked_by_name(ckpts, make_stack) -> None:
    stack = await tier_stack(ckpts, make_stack, "model")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(
            target_pb2.ApplyTierRequest(speculative_num_steps=3, request_steps={"r9": 4})
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_steps[r9] 4" in err.value.details()
