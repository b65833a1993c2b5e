"""Speculation with an EAGLE-3 head is lossless: greedy output equals transformers' greedy
generate, and sampling reproduces the target's own distribution although the head drafts over
a reduced vocabulary (its q is zero at every target id it cannot name).

The sampling test mirrors test_sampling_lossless.py: the exact joint distribution of the first
three tokens from transformers (6-token vocabulary, 216 outcomes) against many seeded runs at
tier 3; a verifier that treats the draft's distribution as if it covered the whole vocabulary
(q read at the draft-vocabulary index, the mapping forgotten) must fail the same test.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import specpair.runtime.target.accepting as target_module
from specpair.models.eagle3_loading import load_eagle3
from specpair.models.tiny import make_tiny_eagle3, make_tiny_llama
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.state import SpecRuntimeState
from tests.engine.test_greedy_lossless import hf_greedy
from tests.engine.test_sampling_lossless import (
    DEPTH,
    PARAMS,
    PROMPT,
    VOCAB,
    exact_joint,
    fit_pvalue,
)

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
NEW_TOKENS, RUNS, BATCH = 24, 4096, 256


def engine(
    target: Path, head: Path, batch: int, max_len: int, tier: int
) -> tuple[SpeculativeEngine, SpecRuntimeState]:
    layers = feature_layers(head, target)
    assert layers
    worker = build_target(target, max_requests=batch, max_len=max_len, feature_layers=layers)
    drafter = build_drafter(head, target_path=target, max_requests=batch, max_len=max_len)
    return SpeculativeEngine(worker, drafter), build_states([tier], worker, drafter)[tier]


@pytest.fixture(scope="module")
def greedy_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3_greedy")
    target = make_tiny_llama(root / "target", seed=1, num_layers=4, tokenizer=False)
    head = make_tiny_eagle3(root / "head", target, seed=3, draft_vocab=200, layers=[0, 1, 2])
    return target, head


@pytest.mark.parametrize("tier", [1, 3, 7])
def test_greedy_matches_transformers(greedy_pair, tier: int) -> None:
    target, head = greedy_pair
    expected = [hf_greedy(target, p) for p in PROMPTS]
    eng, state = engine(target, head, 4, 128, tier)
    results = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS, state=state)
    assert [r.token_ids for r in results] == expected
    assert all(0 <= a <= tier for r in results for a in r.accept_lengths)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3_small_vocab")
    target = make_tiny_llama(
        root / "target", seed=21, vocab_size=VOCAB, tokenizer=False, init_std=0.3, num_layers=3
    )
    # 4 of the 6 ids: the target's two others are never drafted, only sampled by the target.
    return target, make_tiny_eagle3(root / "head", target, seed=22, draft_vocab=4, layers=[0, 1, 1])


def samples(target: Path, head: Path, params: SamplingParams) -> Counter:
    eng, state = engine(target, head, BATCH, 32, DEPTH)
    counts: Counter = Counter()
    for start in range(0, RUNS, BATCH):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i, params.min_p)
            for i in range(BATCH)
        ]
        for r in eng.generate(
            [PROMPT] * BATCH, max_new_tokens=DEPTH, state=state, sampling=sampling
        ):
            counts[tuple(r.token_ids)] += 1
    return counts


@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.8-k4-p0.9", "t0.7-p0.95-minp0.05"])
def test_sampling_matches_target_distribution(small_vocab, params) -> None:
    counts = Counter(samples(*small_vocab, params))
    assert fit_pvalue(counts, exact_joint(small_vocab[0], params)) > 1e-3


def test_unmapped_draft_distribution_fails_the_same_test(small_vocab, monkeypatch) -> None:
    """q read as if draft id i were target id i (the d2t mapping forgotten)."""
    ids = load_eagle3(small_vocab[1], small_vocab[0]).target_ids()
    assert not torch.equal(ids, torch.arange(len(ids)))  # else the mistake changes nothing

    draft_id = {int(t): i for i, t in enumerate(ids)}
    mapped = target_module.sparse_q

    def unmapped(greedy, trees, drafts):
        wrong = [
            t
            if t.draft_ids is None
            else replace(t, draft_ids=t.draft_ids.clone().apply_(lambda x: draft_id.get(x, x)))
            for t in trees
        ]
        return mapped(greedy, wrong, drafts)

    monkeypatch.setattr(target_module, "sparse_q", unmapped)
    counts = Counter(samples(*small_vocab, PARAMS[0]))
    assert fit_pvalue(counts, exact_joint(small_vocab[0], PARAMS[0])) < 1e-6
