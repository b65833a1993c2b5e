"""A drafter started at a window of each request's history (`--draft-window`): the output is
the target alone's, and the drafter is sent exactly the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.round_messages import DraftInput
from tests.engine.test_greedy_lossless import NEW_TOKENS, PROMPTS, hf_greedy

TIER = 3


def generate(
    target: Path, draft: Path, window: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[int]], dict[str, list[int]]]:
    """Greedy outputs, accept lengths, and per request the number of tokens each round sent
    the drafter."""
    worker = build_target(target, max_requests=4, max_len=128, keep_features=True)
    drafter = build_drafter(draft, target_path=target, max_requests=4, max_len=128)
    sent: dict[str, list[int]] = {}
    draft_round = drafter.draft

    def recording(inputs: list[DraftInput], state):  # type: ignore[no-untyped-def]
        for item in inputs:
            sent.setdefault(item.request_id, []).append(len(item.appended))
        return draft_round(inputs, state)

    monkeypatch.setattr(drafter, "draft", recording)
    state = build_states([TIER], worker, drafter)[TIER]
    results = SpeculativeEngine(worker, drafter).generate(
        PROMPTS, max_new_tokens=NEW_TOKENS, state=state, draft_window=window
    )
    return [r.token_ids for r in results], [r.accept_lengths for r in results], sent


@pytest.mark.parametrize("draft", ["target", "eagle"])
@pytest.mark.parametrize("window", [1, 4])
def test_a_windowed_draft_changes_no_token(
    ckpts: dict[str, Path], draft: str, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, _, sent = generate(ckpts["target"], ckpts[draft], window, monkeypatch)
    assert tokens == [hf_greedy(ckpts["target"], p) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        # the first round: the prompt and its first token, cut to the window
        assert sent[f"r{i}"][0] == min(len(prompt) + 1, window), (prompt, sent[f"r{i}"])


def test_a_window_is_what_the_draft_sees(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's own weights as the draft: with the whole history every draft is accepted;
    started at one token, it predicts from less context and loses some (so the window reached
    the drafter's cache, not only the wire)."""
    target = ckpts["target"]
    _, whole, _ = generate(target, target, 0, monkeypatch)
    _, windowed, _ = generate(target, target, 1, monkeypatch)
    long = PROMPTS.index(max(PROMPTS, key=len))
    assert all(a == TIER for a in whole[long][:-1])
    assert sum(windowed[long]) < sum(whole[long])
