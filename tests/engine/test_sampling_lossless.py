"""Speculative sampling reproduces the target's own sampling distribution.

The exact joint distribution of the first three tokens is computed from transformers' model
(6-token vocabulary: 216 outcomes); many seeded speculative runs at tiers 1 and 3 (so
acceptance, rejection with the residual, and the bonus are all exercised) must fit it by a
chi-square test, for every warp (temperature, top-k, top-p, min-p) and for drafts whose q
covers only part of the vocabulary (sparse q). Two deliberately wrong verifiers must fail the
same test: one that accepts every draft, and one whose residual after a rejection is p
instead of norm((p - q)+).
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaForCausalLM

import specpair.runtime.accept as accept_module
import specpair.runtime.sampling as sampling_module
from specpair.models.tiny import make_tiny_eagle3, make_tiny_llama
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams, warp

VOCAB, PROMPT, DEPTH, RUNS, BATCH = 6, [1, 4, 2], 3, 4096, 256
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("small_vocab")
    common = {"vocab_size": VOCAB, "tokenizer": False, "init_std": 0.3}
    return (
        make_tiny_llama(root / "target", seed=21, **common),
        make_tiny_llama(root / "draft", seed=22, num_layers=1, **common),
    )


def exact_joint(target: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    model = LlamaForCausalLM.from_pretrained(target).eval()
    outcomes = list(itertools.product(range(VOCAB), repeat=DEPTH))
    ids = torch.tensor([PROMPT + list(o) for o in outcomes])
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1 : -1]  # predictions of the 3 tokens
    probs = warp(logits, params)
    picked = probs.gather(-1, ids[:, len(PROMPT) :, None])[..., 0]
    return {o: float(p) for o, p in zip(outcomes, picked.prod(-1), strict=True)}


def speculative_samples(
    target: Path,
    draft: Path,
    params: SamplingParams,
    mixed: bool = False,
    tier: int = DEPTH,
    window: int = 0,
) -> Counter:
    """`mixed`: the batch's requests at tiers 0, 1 and 3 in turn, in the same rounds;
    `window`: the prompt's tokens the drafter starts from (0: all). `draft` may be an
    EAGLE-3 head of `target`."""
    layers = feature_layers(draft, target)
    worker = build_target(
        target, max_requests=BATCH, max_len=32, keep_features=bool(layers), feature_layers=layers
    )
    drafter = build_drafter(
        draft, target_path=target if layers else None, max_requests=BATCH, max_len=32
    )
    engine = SpeculativeEngine(worker, drafter)
    state = build_states([tier], worker, drafter)[tier]
    counts: Counter = Counter()
    for start in range(0, RUNS, BATCH):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i, params.min_p)
            for i in range(BATCH)
        ]
        steps = [(0, 1, tier)[i % 3] for i in range(BATCH)] if mixed else None
        results = engine.generate(
            [PROMPT] * BATCH,
            max_new_tokens=DEPTH,
            state=state,
            sampling=sampling,
            request_steps=steps,
            draft_window=window,
        )
        counts.update(tuple(r.token_ids) for r in results)
    return counts


def fit_pvalue(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    total = sum(counts.values())
    big = [o for o, p in expected.items() if p * total >= 5]
    observed = [counts[o] for o in big] + [total - sum(counts[o] for o in big)]
    exp = [expected[o] * total for o in big] + [total * (1 - sum(expected[o] for o in big))]
    scale = sum(observed) / sum(exp)
    return float(chisquare(observed, [e * scale for e in exp]).pvalue)


@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.8-k4-p0.9", "t0.7-p0.95-minp0.05"])
@pytest.mark.parametrize("tier", [1, 3])
def test_speculative_sampling_matches_target_distribution(pair, params, tier) -> None:
    counts = speculative_samples(*pair, params, tier=tier)
    assert fit_pvalue(counts, exact_joint(pair[0], params)) > 1e-3


@pytest.mark.parametrize("support", [1, 2, 4])
def test_sparse_draft_q_keeps_the_target_distribution(pair, support, monkeypatch) -> None:
    """The draft draws from its `support` likeliest tokens only and sends that q sparse."""
    monkeypatch.setattr(sampling_module, "DRAFT_SUPPORT", support)
    counts = speculative_samples(*pair, PARAMS[0])
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


def test_mixed_request_tiers_in_one_batch_match_the_target_distribution(pair) -> None:
    counts = speculative_samples(*pair, PARAMS[0], mixed=True)
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


def test_a_draft_started_at_a_window_keeps_the_target_distribution(pair) -> None:
    """The drafter is sent the prompt's last token only: its q changes, the output's
    distribution does not."""
    counts = speculative_samples(*pair, PARAMS[0], window=1)
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


def test_an_eagle3_head_sampling_its_draft_vocabulary_keeps_the_target_distribution(
    pair, tmp_path
) -> None:
    """The head names 4 of the 6 tokens and draws from them alone (`Eagle3Head.named_logits`):
    its q is zero at the other two, which the target still emits."""
    head = make_tiny_eagle3(tmp_path / "eagle3", pair[0], seed=24, draft_vocab=4, layers=[0, 0, 0])
    counts = speculative_samples(pair[0], head, PARAMS[0])
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


def test_accept_everything_verifier_fails_the_same_test(pair, monkeypatch) -> None:
    def accept_all(p, q, drafts, lengths, u):
        rows = torch.arange(len(lengths))
        return lengths, sampling_module.sample_rows(p[rows, lengths], u[rows, lengths])

    monkeypatch.setattr(accept_module, "accept_chains", accept_all)
    counts = speculative_samples(*pair, PARAMS[0])
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) < 1e-6


def test_a_residual_without_q_subtracted_fails_the_same_test(pair, monkeypatch) -> None:
    monkeypatch.setattr(accept_module, "residual", lambda p, q: p)
    counts = speculative_samples(*pair, PARAMS[0])
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) < 1e-6
