"""An EAGLE-3 head over the two services: the target sends the layers the head reads, output
equals target-only greedy decoding, and a target sending other features refuses the draft at
connect, naming the flag that fixes it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from specpair.models.tiny import make_tiny_eagle3
from specpair.proto.v1 import common_pb2, target_pb2
from tests.service.conftest import draft_config, reference_greedy, target_config

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
INFO = target_pb2.TargetServiceGetServerInfoRequest()


@pytest.fixture(scope="module")
def head(ckpts: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny target has 2 layers: layer 0 is the only one a later layer reads.
    root = tmp_path_factory.mktemp("eagle3_served")
    return make_tiny_eagle3(
        root / "head", ckpts["target"], seed=7, draft_vocab=160, layers=[0, 0, 0]
    )


def eagle3_draft(head: Path, target: Path) -> Any:
    return draft_config(head, draft_kind="eagle", target_path=target, candidate_steps=(1, 3, 7))


@pytest.mark.parametrize("tier", [1, 7])
async def test_eagle3_greedy_over_services(
    ckpts: Any, make_stack: Any, head: Path, tier: int
) -> None:
    stack = await make_stack(
        eagle3_draft(head, ckpts["target"]),
        target_config(ckpts["target"], feature_layers=(0, 0, 0), initial_steps=tier),
    )
    expected = reference_greedy(ckpts["target"], PROMPTS, 20)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=20)
        assert tokens == want
        accepts = [a for r in responses for a in r.speculation.accept_lengths]
        assert accepts and all(0 <= a <= tier for a in accepts)  # rounds were drafted


async def test_target_sending_other_features_refuses_the_draft(
    ckpts: Any, make_stack: Any, head: Path
) -> None:
    stack = await make_stack(
        eagle3_draft(head, ckpts["target"]), target_config(ckpts["target"]), wait_connected=False
    )
    deadline = time.monotonic() + 10
    while (await stack.stub.GetServerInfo(INFO)).draft_connection_state != (
        target_pb2.DRAFT_CONNECTION_STATE_INCOMPATIBLE
    ):
        assert time.monotonic() < deadline, "the draft was never refused"
        await asyncio.sleep(0.05)
    reason = (await stack.stub.GetServerInfo(INFO)).draft_incompatible_reason
    assert "reads target layers [0, 0, 0]" in reason and "--feature-layers 0,0,0" in reason
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=12)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[:1], 12)[0]


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
async def test_float8_features_change_no_output(
    ckpts: Any, make_stack: Any, head: Path, kind: str
) -> None:
    """--feature-dtype float8: the draft receives e4m3 features scaled per row; the target's
    output is unchanged (the tiny heads' drafts are random: acceptance is the benchmarks')."""
    if kind == "eagle3":
        draft, layers = eagle3_draft(head, ckpts["target"]), (0, 0, 0)
    else:
        draft, layers = (
            draft_config(ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"]),
            (),
        )
    stack = await make_stack(
        draft,
        target_config(
            ckpts["target"],
            feature_layers=layers,
            initial_steps=3,
            feature_dtype="float8",
        ),
    )
    rounds = stack.draft.servicer.rounds
    run, dtypes = rounds.run, set()

    def spied(stream_id: str, wire: Any) -> Any:  # a WireRound (`read_round`)
        inputs = wire.message.inputs
        dtypes.update(i.features.dtype for i in inputs if i.HasField("features"))
        return run(stream_id, wire)

    rounds.run = spied
    expected = reference_greedy(ckpts["target"], PROMPTS, 20)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=20) for p in PROMPTS)
    )
    assert [t for t, _ in outputs] == expected
    assert dtypes == {common_pb2.D_TYPE_FLOAT8_E4M3}
    assert all(r.speculation.accept_lengths for _, rs in outputs for r in rs[-1:])  # drafted


@pytest.mark.parametrize("tier", [3, 7])
async def test_an_eagle_head_over_a_token_map_greedy_over_services(
    ckpts: Any, make_stack: Any, tmp_path: Path, tier: int
) -> None:
    """`serve draft --token-map`: the EAGLE-1 head drafts over a third of the ids (its LM head
    that many rows); the target's output is unchanged."""
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(0, 320, 3))))
    draft = draft_config(
        ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"], token_map=token_map
    )
    stack = await make_stack(draft, target_config(ckpts["target"], initial_steps=tier))
    head = stack.draft.servicer.rounds.drafter.head
    assert head.lm_head.weight.shape[0] == 107  # the map's rows only
    expected = reference_greedy(ckpts["target"], PROMPTS, 20)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=20)
        assert tokens == want
        assert [a for r in responses for a in r.speculation.accept_lengths]  # rounds were drafted


def _eagle(ckpts: Any, head: Path, kind: str) -> tuple[Any, tuple[int, ...]]:
    if kind == "eagle3":
        return eagle3_draft(head, ckpts["target"]), (0, 0, 0)
    return draft_config(ckpts["eagle"], draft_kind="eagle", target_path=ckpts["target"]), ()


def _spy_features(rounds: Any) -> dict[str, int]:
    """Counts the inputs whose features came as bytes and as spans of the ring."""
    run, seen = rounds.run, {"bytes": 0, "shared": 0}

    def spied(stream_id: str, wire: Any) -> Any:  # a WireRound (`read_round`)
        seen["bytes"] += sum(i.HasField("features") for i in wire.message.inputs)
        seen["shared"] += sum(i.HasField("shared_features") for i in wire.message.inputs)
        return run(stream_id, wire)

    rounds.run = spied
    return seen


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
async def test_features_cross_by_reference_and_change_no_output(
    ckpts: Any, make_stack: Any, head: Path, kind: str
) -> None:
    """A draft on this host maps the target's feature ring (`--feature-ring-mib`): every
    round's and every hand-off's features go as spans of it, none as bytes, and the output is
    the target's."""
    draft, layers = _eagle(ckpts, head, kind)
    stack = await make_stack(
        draft,
        target_config(ckpts["target"], feature_layers=layers, initial_steps=3, feature_ring_mib=8),
    )
    seen = _spy_features(stack.draft.servicer.rounds)
    expected = reference_greedy(ckpts["target"], PROMPTS, 20)
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=20) for p in PROMPTS)
    )
    assert [t for t, _ in outputs] == expected
    assert seen["shared"] > len(PROMPTS) and seen["bytes"] == 0
    assert all(r.speculation.accept_lengths for _, rs in outputs for r in rs[-1:])  # drafted


async def test_a_draft_that_cannot_map_the_ring_gets_bytes(
    ckpts: Any, make_stack: Any, head: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft on another host (here: one whose mapping fails) answers the probe with why;
    the target sends bytes, the output is the same."""

    def unmappable(*_: Any) -> Any:
        raise FileNotFoundError("/proc/1/fd/3: not this host's")

    monkeypatch.setattr("draft_service.rounds.RingView", unmappable)
    draft, layers = _eagle(ckpts, head, "eagle3")
    stack = await make_stack(
        draft,
        target_config(ckpts["target"], feature_layers=layers, initial_steps=3, feature_ring_mib=8),
    )
    seen = _spy_features(stack.draft.servicer.rounds)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=20)
    assert tokens == reference_greedy(ckpts["target"], PROMPTS[:1], 20)[0]
    assert seen["bytes"] > 0 and seen["shared"] == 0
