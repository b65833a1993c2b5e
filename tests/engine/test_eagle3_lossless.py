"""Speculation over a reduced draft vocabulary is lossless, for an EAGLE-3 head (its own d2t)
and an EAGLE-1 head given a token map (`draft_vocab.py`): greedy output equals transformers'
greedy generate, and sampling reproduces the target's own distribution although the head drafts
over a reduced vocabulary (its q is zero at every target id it cannot name).

The sampling test mirrors test_sampling_lossless.py: the exact joint distribution of the first
three tokens from transformers (6-token vocabulary, 216 outcomes) against many seeded runs at
tier 3; a verifier that treats the draft's distribution as if it covered the whole vocabulary
(q read at the draft-vocabulary index, the mapping forgotten) must fail the same test.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import specpair.runtime.target.accepting as target_module
from specpair.models.draft_vocab import target_ids
from specpair.models.eagle3_loading import load_eagle3
from specpair.models.loading import load_eagle, read_args
from specpair.models.tiny import make_tiny_eagle, make_tiny_eagle3, make_tiny_llama
from specpair.models.token_map import load_token_map
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
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
KINDS = ["eagle3", "mapped"]  # an EAGLE-3 head; an EAGLE-1 head with a token map


@dataclass(frozen=True)
class Pair:
    target: Path
    head: Path
    token_map: Path | None = None  # the EAGLE-1 head's

    def target_ids(self) -> torch.Tensor:
        if self.token_map is None:
            return load_eagle3(self.head, self.target).target_ids()
        ids = load_token_map(self.token_map, read_args(self.target).vocab_size)
        d2t = load_eagle(self.head, self.target, token_map=ids).d2t
        assert d2t is not None
        return target_ids(d2t)


def pair(root: Path, target: Path, kind: str, draft_vocab: int, seed: int) -> Pair:
    """`kind`'s head over `draft_vocab` of the target's ids (the EAGLE-3 head's own pick; the
    token map: every other id from 1, so no draft id is its target id past the first)."""
    if kind == "eagle3":
        layers = [0, 1, 1]
        return Pair(
            target,
            make_tiny_eagle3(
                root / kind, target, seed=seed, draft_vocab=draft_vocab, layers=layers
            ),
        )
    token_map = root / "map.json"
    token_map.write_text(json.dumps(list(range(1, 2 * draft_vocab, 2))))
    return Pair(target, make_tiny_eagle(root / kind, target, seed=seed), token_map)


def engine(
    p: Pair, batch: int, max_len: int, tier: int
) -> tuple[SpeculativeEngine, SpecRuntimeState]:
    layers = feature_layers(p.head, p.target)
    assert bool(layers) == (p.token_map is None)
    worker = build_target(
        p.target, max_requests=batch, max_len=max_len, feature_layers=layers, keep_features=True
    )
    drafter = build_drafter(
        p.head, target_path=p.target, max_requests=batch, max_len=max_len, token_map=p.token_map
    )
    return SpeculativeEngine(worker, drafter), build_states([tier], worker, drafter)[tier]


@pytest.fixture(scope="module", params=KINDS)
def greedy_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    root = tmp_path_factory.mktemp(f"{request.param}_greedy")
    target = make_tiny_llama(root / "target", seed=1, num_layers=4, tokenizer=False)
    return pair(root, target, request.param, 150, 3)


@pytest.mark.parametrize("tier", [1, 3, 7, TreeShape(3, 3, 6)], ids=str)
def test_greedy_matches_transformers(greedy_pair: Pair, tier: int | TreeShape) -> None:
    expected = [hf_greedy(greedy_pair.target, p) for p in PROMPTS]
    eng, state = engine(greedy_pair, 4, 128, tier)
    results = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS, state=state)
    assert [r.token_ids for r in results] == expected
    steps = TreeShape(tier).steps if isinstance(tier, int) else tier.steps
    assert all(0 <= a <= steps for r in results for a in r.accept_lengths)


@pytest.fixture(scope="module", params=KINDS)
def small_vocab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    root = tmp_path_factory.mktemp(f"{request.param}_small_vocab")
    target = make_tiny_llama(
        root / "target", seed=21, vocab_size=VOCAB, tokenizer=False, init_std=0.3, num_layers=3
    )
    # 3 of the 6 ids: the target's others are never drafted, only sampled by the target.
    return pair(root, target, request.param, 3, 22)


def samples(p: Pair, params: SamplingParams) -> Counter:
    eng, state = engine(p, BATCH, 32, DEPTH)
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
def test_sampling_matches_target_distribution(small_vocab: Pair, params) -> None:
    counts = Counter(samples(small_vocab, params))
    assert fit_pvalue(counts, exact_joint(small_vocab.target, params)) > 1e-3


def test_unmapped_draft_distribution_fails_the_same_test(small_vocab: Pair, monkeypatch) -> None:
    """q read as if draft id i were target id i (the d2t mapping forgotten)."""
    ids = small_vocab.target_ids()
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
    counts = Counter(samples(small_vocab, PARAMS[0]))
    assert fit_pvalue(counts, exact_joint(small_vocab.target, PARAMS[0])) < 1e-6
