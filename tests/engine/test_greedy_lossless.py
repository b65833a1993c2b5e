"""Greedy speculative decoding equals transformers' greedy generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
NEW_TOKENS = 24


def hf_greedy(path: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """`transformers`' greedy continuation of `prompt`, exactly `new_tokens` long (no EOS)."""
    model = LlamaForCausalLM.from_pretrained(path).eval()
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {t: [hf_greedy(ckpts[t], p) for p in PROMPTS] for t in ("target", "target_b")}


def run(
    target: Path,
    draft: Path | None,
    tier: int,
    prompts: list[list[int]],
    request_steps: list[int] | None = None,
):
    worker = build_target(target, max_requests=4, max_len=128, keep_features=True)
    drafter = None
    if draft is not None:
        drafter = build_drafter(draft, target_path=target, max_requests=4, max_len=128)
    engine = SpeculativeEngine(worker, drafter)
    state = build_states([tier], worker, drafter)[tier]
    return engine.generate(
        prompts, max_new_tokens=NEW_TOKENS, state=state, request_steps=request_steps
    )


@pytest.mark.parametrize("tier", [1, 3, 7])
@pytest.mark.parametrize(
    ("target", "draft"),
    [
        ("target", "target"),  # identical draft: every draft accepted
        ("target", "draft"),  # unrelated draft: acceptance mostly 0
        ("target", "eagle"),  # random EAGLE head over the wire format's features
        ("target_b", "target_b"),
        ("target_b", "draft_b"),
    ],
)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_transformers(
    ckpts: dict[str, Path], references, target: str, draft: str, tier: int, batch: int
) -> None:
    prompts = PROMPTS if batch == 4 else PROMPTS[1:2]
    expected = references[target] if batch == 4 else references[target][1:2]
    results = run(ckpts[target], ckpts[draft], tier, prompts)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    lengths = [a for r in results for a in r.accept_lengths]
    assert all(0 <= a <= tier for a in lengths)
    if draft == target:
        # every round but possibly the truncated last one accepts all s drafts
        assert all(a == tier for r in results for a in r.accept_lengths[:-1])
    if draft == "draft":
        assert sum(lengths) / len(lengths) < 0.5


def test_plain_decoding_matches_transformers(ckpts: dict[str, Path], references) -> None:
    results = run(ckpts["target"], None, 3, PROMPTS)
    assert [r.token_ids for r in results] == references["target"]


def test_stop_token_ends_request(ckpts: dict[str, Path], references) -> None:
    worker = build_target(ckpts["target"], max_requests=4, max_len=128)
    drafter = build_drafter(ckpts["target"], target_path=None, max_requests=4, max_len=128)
    expected = references["target"][0]
    stop = expected[5]
    first = expected.index(stop)
    results = SpeculativeEngine(worker, drafter).generate(
        PROMPTS[:1],
        max_new_tokens=NEW_TOKENS,
        state=build_states([7], worker, drafter)[7],
        stop_token_ids=frozenset({stop}),
    )
    assert results[0].token_ids == expected[: first + 1]
    assert results[0].finish_reason == "stop"


@pytest.mark.parametrize("draft", ["target", "draft", "eagle"])
def test_per_request_tiers_in_one_batch_match_transformers(
    ckpts: dict[str, Path], references, draft: str
) -> None:
    """One batch, tiers 0, 1, 3, 7 (the state of 7): each request drafts to its own depth."""
    steps = [0, 1, 3, 7]
    results = run(ckpts["target"], ckpts[draft], 7, PROMPTS, steps)
    assert [r.token_ids for r in results] == references["target"]
    for r, s in zip(results, steps, strict=True):
        assert all(0 <= a <= s for a in r.accept_lengths)
        if draft == "target":
            assert all(a == s for a in r.accept_lengths[:-1])
            # the prefill gave the first token; each round s drafts + the bonus
            assert len(r.accept_lengths) == -(-(NEW_TOKENS - 1) // (s + 1))
