"""Target + draft services over real gRPC: lossless output, degradation, bad input, ops."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import free_port
from specpair.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from tests.service.conftest import (
    draft_config,
    eventually,
    fake_draft,
    reference_greedy,
    target_config,
)

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
MAX_TOKENS = 30


@pytest.mark.parametrize(
    ("kind", "busy_poll_ms"), [("model", None), ("eagle", None), ("eagle", 5.0)]
)
async def test_concurrent_greedy_equals_target_only(
    ckpts, make_stack, kind: str, busy_poll_ms: float | None
) -> None:
    draft = ckpts["eagle"] if kind == "eagle" else ckpts["target"]
    stack = await make_stack(
        draft_config(
            draft, draft_kind=kind, target_path=ckpts["target"], busy_poll_ms=busy_poll_ms
        ),
        target_config(ckpts["target"], busy_poll_ms=busy_poll_ms),
    )
    expected = reference_greedy(ckpts["target"], PROMPTS, MAX_TOKENS)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS)
    )
    assert [tokens for tokens, _ in outputs] == expected
    final = [responses[-1] for _, responses in outputs]
    assert all(f.finish_reason != target_pb2.FINISH_REASON_UNSPECIFIED for f in final)
    assert all(
        f.usage.completion_tokens == len(t) for f, (t, _) in zip(final, outputs, strict=True)
    )
    if kind == "model":  # identical draft: every full round accepts all 3 drafts
        assert any(a == 3 for f in final for a in f.speculation.accept_lengths)
        assert all(f.speculation.plain_rounds == 0 for f in final)


async def test_draft_over_a_unix_socket(ckpts, make_stack) -> None:
    """Services on one host may link over a Unix domain socket (`--address unix:PATH`)."""
    sockets = tempfile.mkdtemp(prefix="specpair-")  # short: socket paths stop at ~107 bytes
    try:
        address = f"unix:{sockets}/draft.sock"
        cfg = draft_config(ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"])
        stack = await make_stack(
            replace(cfg, server=replace(cfg.server, address=address)),
            target_config(ckpts["target"]),
        )
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
        assert info.draft_address == address
        tokens, responses = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=20)
        assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 20)[0]
        stats = responses[-1].speculation
        assert stats.plain_rounds == 0 and stats.rounds > 0
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


async def test_no_draft_decodes_plainly(ckpts, make_stack) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    tokens, responses = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], MAX_TOKENS)[0]
    assert all(r.accept_length == -1 for r in responses)
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert info.draft_connection_state == target_pb2.DRAFT_CONNECTION_STATE_NONE


async def test_draft_killed_mid_generation_loses_nothing(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    long = 120
    expected = reference_greedy(ckpts["target"], PROMPTS, long)

    async def kill_then_revive() -> None:
        await asyncio.sleep(0.3)
        await stack.stop_draft()
        await asyncio.sleep(0.5)
        await stack.restart_draft()

    chaos = asyncio.create_task(kill_then_revive())
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=long) for p in PROMPTS)
    )
    await chaos
    assert [tokens for tokens, _ in outputs] == expected
    # after the restart the target reconnects and speculates again
    await stack.wait_draft_connected()
    tokens, responses = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=20)
    assert tokens == expected[0][:20]
    assert responses[-1].speculation.rounds > responses[-1].speculation.plain_rounds


BAD_REQUESTS = [
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1], "max_tokens": 5}, "prompt"),
    ({"prompt_token_ids": [1, 99999], "max_tokens": 5}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": [1, -3], "max_tokens": 5}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": [1], "max_tokens": -1}, "max_tokens"),
    ({"prompt_token_ids": [1], "max_tokens": 5000}, "max_tokens"),
    ({"prompt_token_ids": [1], "max_tokens": 5, "sampling": {"temperature": -1}}, "temperature"),
    ({"prompt_token_ids": [1], "max_tokens": 5, "sampling": {"top_p": 0.0}}, "top_p"),
    ({"prompt_token_ids": [1], "max_tokens": 5, "sampling": {"top_p": 1.5}}, "top_p"),
    ({"prompt_token_ids": [1], "max_tokens": 5, "sampling": {"top_k": -1}}, "top_k"),
    ({"prompt_token_ids": [1], "max_tokens": 5, "stop_token_ids": [400]}, "stop_token_ids[0]"),
]


async def test_bad_input_names_the_field_and_spares_others(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    good = asyncio.create_task(stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=60))
    for kwargs, field in BAD_REQUESTS:
        if "sampling" in kwargs:
            kwargs = {**kwargs, "sampling": common_pb2.SamplingParams(**kwargs["sampling"])}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.generate(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert err.value.details().startswith(field) or field in err.value.details(), (
            kwargs,
            err.value.details(),
        )
    tokens, _ = await good
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[1:2], 60)[0]


async def test_apply_tier_between_rounds_without_builds(ckpts, make_stack) -> None:
    """Each ApplyTier takes effect in the next round to start and no earlier: every round runs
    at one tier, drafting and verifying that many tokens, and switching builds nothing."""
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))

    def builds() -> tuple[int, int]:
        target, draft = stack.target.servicer.builder, stack.draft.servicer.rounds.builder
        return target.builds + target.captures, draft.builds + draft.captures

    await stack.wait_draft_connected()
    before = builds()
    # one state per candidate tier, at start-up (the draft's tier 0 too: prompt hand-offs)
    assert before == (3, 4)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(target_pb2.ApplyTierRequest(speculative_num_steps=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative_num_steps" in err.value.details()
    rounds: dict[int, target_pb2.RoundStats] = {}

    async def watch() -> None:
        async for update in stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()):
            rounds[update.round.round_id] = update.round

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.2)  # the watch is open before the first round
    expected = reference_greedy(ckpts["target"], PROMPTS[:1], 80)[0]
    tokens: list[int] = []
    applied: list[tuple[int, int]] = []  # (the round last started when it landed, tier)
    async for r in stack.stub.Generate(
        target_pb2.GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=80)
    ):
        tokens += r.token_ids
        # A round at tier s verifies at most s drafts: accepted drafts + the bonus token.
        assert r.accept_length <= r.speculative_num_steps
        assert len(r.token_ids) <= r.speculative_num_steps + 1 or r.accept_length == -1
        tier = {3: 7, 7: 1, 1: 3}[r.speculative_num_steps]
        reply = await stack.stub.ApplyTier(target_pb2.ApplyTierRequest(speculative_num_steps=tier))
        applied.append((reply.current_round, tier))
    await eventually(lambda: max(rounds, default=0) >= max(c for c, _ in applied))
    watcher.cancel()
    assert tokens == expected
    # The round that starts next runs at the tier last asked for before it started.
    asked = dict(applied)  # of several calls that landed in the same round, the last wins
    followed = {c: t for c, t in asked.items() if c + 1 in rounds}
    assert len(followed) > 5
    assert {c: rounds[c + 1].speculative_num_steps for c in followed} == followed
    assert {1, 3, 7} <= {s.speculative_num_steps for s in rounds.values()}
    for stats in rounds.values():
        assert stats.speculative and stats.accept_lengths
        assert max(stats.accept_lengths) <= stats.speculative_num_steps
    assert builds() == before  # switching swapped references, built nothing


async def test_cancelled_request_frees_state_on_both_services(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    call = stack.stub.Generate(target_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=400))
    async for _ in call:
        break
    call.cancel()
    for _ in range(50):
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
        if info.running_requests == 0 and stack.draft.servicer.rounds.active_requests == 0:
            break
        await asyncio.sleep(0.05)
    assert info.running_requests == 0
    assert stack.target.servicer.scheduler.worker.cache.free_slots == 16
    assert stack.draft.servicer.rounds.active_requests == 0
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[2], max_tokens=10)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[2:3], 10)[0]


async def test_sampling_over_the_wire_is_reproducible(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["draft"]), target_config(ckpts["target"]))
    sampling = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    a, ra = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=40, sampling=sampling)
    b, _ = await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=40, sampling=sampling)
    assert a == b and len(a) == 40 and all(0 <= t < 320 for t in a)
    assert ra[-1].speculation.plain_rounds == 0


async def test_a_sampled_rounds_q_goes_as_one_tensor(ckpts, make_stack) -> None:
    """Sampled rounds answer with their trees' q in two tensors for the round (not two a
    tree), and the target decodes them: no round falls back to plain decoding."""
    stack = await make_stack(draft_config(ckpts["draft"]), target_config(ckpts["target"]))
    rounds, run = stack.draft.servicer.rounds, stack.draft.servicer.rounds.run
    together = []

    def spied(stream_id: str, message: Any) -> Any:
        answer = run(stream_id, message)
        if any(t.token_ids for t in answer.message.trees):
            together.append(answer.message.HasField("draft_probs"))
        return answer

    rounds.run = spied
    sampling = common_pb2.SamplingParams(temperature=0.9, seed=3)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=24, sampling=sampling) for p in PROMPTS)
    )
    assert together and all(together)
    assert all(rs[-1].speculation.plain_rounds == 0 for _, rs in outputs)


async def watch_rounds(stack: Any) -> tuple[list[target_pb2.RoundStats], asyncio.Task[None]]:
    """The target's RoundStats as they come (the watch is open when this returns); cancel the
    task to stop."""
    rounds: list[target_pb2.RoundStats] = []

    async def watch() -> None:
        async for update in stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()):
            rounds.append(update.round)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    return rounds, watcher


async def test_round_stats_count_the_sampled_requests(ckpts, make_stack) -> None:
    """The controller's goodput kind models greedy and sampled batches apart: each round says
    how many of its requests sample."""
    stack = await make_stack(draft_config(ckpts["draft"]), target_config(ckpts["target"]))
    await stack.wait_draft_connected()
    rounds, watcher = await watch_rounds(stack)
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=5)  # no early stop token
    await asyncio.gather(
        stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=24, sampling=sampling),
        stack.generate(prompt_token_ids=PROMPTS[2], max_tokens=24),
    )
    await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=8)
    await eventually(lambda: sum(r.batch_size for r in rounds) >= 3)
    watcher.cancel()
    pairs = {(r.batch_size, r.sampled_requests) for r in rounds}
    assert (2, 1) in pairs and (1, 0) in pairs
    assert all(r.sampled_requests <= min(r.batch_size, 1) for r in rounds)
    assert rounds[-1].sampled_requests == 0  # the greedy request alone
    # the rows each verify computed: a row a request and its drafts (the CPU's eager verify
    # pads nothing); a round where the draft's chains ran full, batch × (steps + 1)
    assert all(r.verify_rows >= r.batch_size for r in rounds)
    full = [r.batch_size * (r.speculative_num_steps + 1) for r in rounds]
    assert any(r.verify_rows == n > r.batch_size for r, n in zip(rounds, full, strict=True))
    # where the accepts ran: batched on the logits' device (the CPU has no accept graphs)
    samples = stack.target.servicer.scheduler.metrics.accepts.collect()[0].samples
    paths = {s.labels["path"]: s.value for s in samples if s.name.endswith("_total")}
    assert paths.get("device", 0) > 0 and paths.get("greedy", 0) > 0
    assert "graph" not in paths and "host" not in paths


async def test_a_batch_runs_at_its_sampling_regimes_tier_from_its_first_round(
    ckpts, make_stack
) -> None:
    """With a tier per regime (greedy 3, sampled 0) a sampled request runs without drafts and
    a greedy one drafts 3, each from its first round: no round waits for the controller."""
    stack = await make_stack(
        draft_config(ckpts["draft"]), target_config(ckpts["target"], candidate_steps=(0, 1, 3))
    )
    await stack.wait_draft_connected()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(
            target_pb2.ApplyTierRequest(speculative_num_steps=3, greedy_steps=3, sampled_steps=7)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampled_steps 7" in err.value.details()
    await stack.stub.ApplyTier(
        target_pb2.ApplyTierRequest(speculative_num_steps=3, greedy_steps=3, sampled_steps=0)
    )
    rounds, watcher = await watch_rounds(stack)
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=5)
    await stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=12, sampling=sampling)
    await eventually(lambda: len(rounds) >= 11)
    sampled_rounds = len(rounds)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=24)
    await eventually(lambda: sum(r.sampled_requests == 0 for r in rounds) >= 1)
    await asyncio.sleep(0.2)
    watcher.cancel()
    assert all(r.sampled_requests == 1 and r.speculative_num_steps == 0 for r in rounds[:11])
    greedy = rounds[sampled_rounds:]
    assert greedy and all(r.speculative_num_steps == 3 and r.speculative for r in greedy)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[:1], 24)[0]
    info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert info.speculative_num_steps == 3


async def test_text_prompt_streams_text(ckpts, make_stack) -> None:
    from transformers import AutoTokenizer

    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    tokens, responses = await stack.generate(prompt="def main(argv):", max_tokens=40)
    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    text = "".join(r.text for r in responses)
    assert responses[0].request_id and len(tokens) > 0
    assert text == tok.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    assert responses[-1].usage.prompt_tokens == len(tok.encode("def main(argv):"))


class GarbageDraft(draft_pb2_grpc.DraftServiceServicer):
    """A buggy draft: trees with cycles, out-of-vocabulary tokens, wrong depth."""

    def __init__(self) -> None:
        self.rounds = 0

    async def Round(
        self, request_iterator: AsyncIterator[draft_pb2.RoundRequest], context
    ) -> AsyncIterator[draft_pb2.RoundResponse]:
        async for req in request_iterator:
            self.rounds += 1
            bad = [
                draft_pb2.CandidateTree(token_ids=[1, 2], parents=[1, 0]),
                draft_pb2.CandidateTree(token_ids=[99999], parents=[-1]),
                draft_pb2.CandidateTree(token_ids=[1] * 20, parents=list(range(-1, 19))),
            ]
            trees = []
            for i, item in enumerate(req.inputs):
                tree = draft_pb2.CandidateTree()
                tree.CopyFrom(bad[(self.rounds + i) % len(bad)])
                tree.request_id = item.request_id
                trees.append(tree)
            yield draft_pb2.RoundResponse(round_id=req.round_id, trees=trees)

    async def GetServerInfo(self, request, context):
        return draft_pb2.DraftServiceGetServerInfoResponse(draft_kind="model")


async def test_malformed_trees_fall_back_to_plain_decoding(ckpts, make_stack) -> None:
    garbage = GarbageDraft()
    async with fake_draft(garbage) as address:
        stack = await make_stack(None, target_config(ckpts["target"], draft_address=address))
        await stack.wait_draft_connected()
        outputs = await asyncio.gather(
            *(stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS)
        )
        assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], PROMPTS, MAX_TOKENS)
        assert garbage.rounds > 0
        assert all(r[-1].speculation.accept_lengths == [] for _, r in outputs)


async def test_health_serving_and_ops_token(ckpts, make_stack, monkeypatch) -> None:
    from dataclasses import replace

    cfg = target_config(ckpts["target"], draft_address=None)
    cfg = replace(cfg, server=replace(cfg.server, ops_token="s3cret"))
    stack = await make_stack(None, cfg)
    health = health_pb2_grpc.HealthStub(stack.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    request = target_pb2.ApplyTierRequest(speculative_num_steps=7)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(request)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.ApplyTier(request, metadata=(("authorization", "Bearer nope"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = await stack.stub.ApplyTier(request, metadata=(("authorization", "Bearer s3cret"),))
    assert ok.speculative_num_steps == 7
    # Generate stays open to clients without the ops token
    tokens, _ = await stack.generate(prompt_token_ids=[1, 2, 3], max_tokens=3)
    assert len(tokens) == 3


class SlowReleaseDraft(GarbageDraft):
    """Drafts nothing; answers release-only messages late, as a busy draft might."""

    async def Round(
        self, request_iterator: AsyncIterator[draft_pb2.RoundRequest], context
    ) -> AsyncIterator[draft_pb2.RoundResponse]:
        async for req in request_iterator:
            if not req.inputs:
                self.rounds += 1
                await asyncio.sleep(0.3)
            yield draft_pb2.RoundResponse(round_id=req.round_id)


async def test_request_submitted_while_releases_flush_is_served(ckpts, make_stack) -> None:
    draft = SlowReleaseDraft()
    async with fake_draft(draft) as address:
        stack = await make_stack(None, target_config(ckpts["target"], draft_address=address))
        await stack.wait_draft_connected()
        for prompt in PROMPTS:  # each arrives while the previous one's release is in flight
            await asyncio.sleep(0.1)
            tokens, _ = await asyncio.wait_for(
                stack.generate(prompt_token_ids=prompt, max_tokens=5), timeout=10
            )
            assert len(tokens) == 5
        assert draft.rounds >= 3  # the release-only path really ran


async def test_full_queue_is_resource_exhausted_and_others_finish(ckpts, make_stack) -> None:
    stack = await make_stack(
        None, target_config(ckpts["target"], draft_address=None, max_batch=1, max_queue=1)
    )
    running = asyncio.create_task(stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=200))
    while stack.target.servicer.scheduler.running == []:  # the first one holds the only slot
        await asyncio.sleep(0.01)
    queued = asyncio.create_task(stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=5))
    while not stack.target.servicer.scheduler.queue:
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_token_ids=PROMPTS[2], max_tokens=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue" in err.value.details()
    (first, _), (second, _) = await asyncio.gather(running, queued)
    assert len(first) == 200 and len(second) == 5


async def test_metrics_endpoint_exports_the_serving_metrics(ckpts, make_stack) -> None:
    import urllib.request
    from dataclasses import replace

    port = free_port()
    cfg = target_config(ckpts["target"])
    cfg = replace(cfg, server=replace(cfg.server, metrics_address=f"127.0.0.1:{port}"))
    stack = await make_stack(draft_config(ckpts["target"]), cfg)
    await stack.wait_draft_connected()
    await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=20)
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in (
        "specpair_target_accept_length_bucket",
        "specpair_target_speculative_num_steps 3.0",
        "specpair_target_tier_switches_total",
        'specpair_target_stage_seconds_count{stage="verify"}',
        "specpair_target_time_to_first_token_seconds_count 1.0",
        "specpair_target_inter_token_latency_seconds_count",
        "specpair_target_running_requests",
        "specpair_target_queued_requests",
    ):
        assert name in body, name


@pytest.mark.parametrize(
    ("handoff", "window", "ride", "ahead"),
    [
        (True, 0, 0, False),
        (False, 0, 0, False),
        (True, 2, 0, False),
        (False, 3, 0, False),
        (True, 0, 256, False),
        (True, 2, 256, False),
        (True, 0, 256, True),
        (True, 2, 256, True),
    ],
)
async def test_a_request_joining_beside_a_round_has_its_prompt_handed_off(
    ckpts, make_stack, handoff: bool, window: int, ride: int, ahead: bool
) -> None:
    """An EAGLE request that joins while another's round is out to the draft: its prompt and
    features reach the draft at tier 0 right behind that round, and its first round appends
    one token (`--no-prompt-handoff`: the whole prompt goes with its first round). With
    `--draft-window N` only the last N tokens go. With `ride_rows` its prompt rides in that
    round's verify instead of a prefill of its own, and goes to the draft after it (with
    `handoff_ahead` unawaited: its first round follows at once, flagged `continues`, and the
    draft, holding the prompt by then, drafts it). Its tokens are the target alone's in every
    case."""
    stack = await make_stack(
        draft_config(ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"]),
        replace(
            target_config(ckpts["target"]),
            no_prompt_handoff=not handoff,
            draft_window=window,
            ride_rows=ride,
            handoff_awaited=not ahead,
        ),
    )
    rounds = stack.draft.servicer.rounds
    seen: list[tuple[int, str, int]] = []  # (tier, request id, tokens appended) per input
    continued: list[str] = []  # the inputs flagged `continues`
    draft = rounds.draft

    def recording(stream_id: str, request: Any) -> Any:
        tier = request.speculative_num_steps
        seen.extend((tier, i.request_id, len(i.appended)) for i in request.inputs)
        continued.extend(i.request_id for i in request.inputs if i.continues)
        return draft(stream_id, request)

    rounds.draft = recording
    long, joiner = PROMPTS[1], PROMPTS[3]
    first = asyncio.create_task(stack.generate(prompt_token_ids=long, max_tokens=MAX_TOKENS))
    await eventually(lambda: len(seen) >= 2)  # the first request is decoding
    tokens, _ = await stack.generate(prompt_token_ids=joiner, max_tokens=MAX_TOKENS)
    await first
    assert tokens == reference_greedy(ckpts["target"], [joiner], MAX_TOKENS)[0]
    (rid,) = {r for _, r, _ in seen} - {seen[0][1]}  # the joiner's id
    mine = [(tier, n) for tier, r, n in seen if r == rid]
    if handoff:  # the prompt (or its window), then its first token
        assert mine[:2] == [(0, window or len(joiner)), (3, 1)]
    else:
        assert mine[0] == (3, window or len(joiner) + 1) and all(tier for tier, _ in mine)
    registry = stack.target.servicer.frontend.metrics.registry
    joins = {
        how: registry.get_sample_value("specpair_target_joins_total", {"how": how}) or 0
        for how in ("prefill", "ride")
    }
    assert joins == ({"prefill": 1, "ride": 1} if ride else {"prefill": 2, "ride": 0})
    assert continued == ([rid] if ahead else [])
    refused = registry.get_sample_value(
        "specpair_target_plain_rounds_total", {"reason": "draft_refused"}
    )
    assert not refused, "the draft held every request it was asked to continue"


@pytest.mark.parametrize("feed", [True, False])
async def test_rounds_at_tier_0_keep_the_draft_fed_when_told(ckpts, make_stack, feed: bool) -> None:
    """An EAGLE request decoded at tier 0, then at tier 3. Fed (`feed_draft_at_tier_0`, a
    lab switch), each tier-0 round sends the draft what it has not seen, so the first tier-3
    round appends one token; unfed, the draft hears nothing at tier 0, and the first tier-3
    round carries the prompt and every token decoded since. Its tokens are the target alone's
    either way."""
    target = target_config(
        ckpts["target"], candidate_steps=(0, 3), initial_steps=0, feed_draft_at_tier_0=feed
    )
    stack = await make_stack(
        draft_config(ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"]), target
    )
    rounds = stack.draft.servicer.rounds
    seen: list[tuple[int, int]] = []  # (tier, tokens appended) per input
    draft = rounds.draft

    def recording(stream_id: str, request: Any) -> Any:
        seen.extend((request.speculative_num_steps, len(i.appended)) for i in request.inputs)
        return draft(stream_id, request)

    rounds.draft = recording
    prompt = PROMPTS[1]
    tokens: list[int] = []
    call = stack.stub.Generate(
        target_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS)
    )
    async for r in call:
        tokens += r.token_ids
        if len(tokens) == 6:  # six rounds at tier 0
            await stack.stub.ApplyTier(target_pb2.ApplyTierRequest(speculative_num_steps=3))
    assert tokens == reference_greedy(ckpts["target"], [prompt], MAX_TOKENS)[0]
    fed = [n for tier, n in seen if tier == 0]
    first = next(n for tier, n in seen if tier == 3)
    if feed:
        assert fed[0] == len(prompt) + 1 and set(fed[1:]) == {1}, fed
        assert len(fed) >= 6 and first == 1
    else:
        assert not fed and first >= len(prompt) + 6


@pytest.mark.parametrize("window", [0, 8])
async def test_a_window_lets_a_prompt_longer_than_the_draft_cache_draft(
    ckpts, make_stack, window: int
) -> None:
    """A 40-token prompt and a draft whose cache holds 32 positions: with the whole history
    the draft refuses it (no room) and every round decodes plainly; started at the last 8
    tokens every round is drafted. The tokens are the target alone's either way."""
    stack = await make_stack(
        draft_config(ckpts["target"], max_len=32),
        target_config(ckpts["target"], draft_window=window),
    )
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=16)
    assert tokens == reference_greedy(ckpts["target"], [prompt], 16)[0]
    speculation = responses[-1].speculation
    if window:  # every round drafted (a random model from 8 tokens rarely guesses right)
        assert speculation.accept_lengths and speculation.plain_rounds == 0
    else:
        assert not speculation.accept_lengths and speculation.plain_rounds > 0
