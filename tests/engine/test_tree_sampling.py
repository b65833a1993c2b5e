"""Sampled candidate trees reproduce the target's own sampling distribution.

The same exact joint as `test_sampling_lossless.py` (6-token vocabulary, the first three
tokens: 216 outcomes) against many seeded speculative runs at tree shapes, verified by SGLang's
target-only rule (`accept.accept_trees`); a verifier that accepts every first child must fail.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import specpair.runtime.accept as accept_module
from specpair.runtime.build import StateBuilder, build_drafter, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from tests.engine.test_sampling_lossless import (
    BATCH,
    DEPTH,
    PARAMS,
    PROMPT,
    RUNS,
    exact_joint,
    fit_pvalue,
    pair,  # noqa: F401  (the fixture)
)

SHAPES = [TreeShape(3, 2, 4), TreeShape(3, 3, 9), TreeShape(2, 3, 5)]


def tree_samples(target: Path, draft: Path, params: SamplingParams, shape: TreeShape) -> Counter:
    worker = build_target(target, max_requests=BATCH, max_len=32)
    drafter = build_drafter(draft, target_path=None, max_requests=BATCH, max_len=48)
    engine = SpeculativeEngine(worker, drafter)
    state = StateBuilder(worker, drafter).build(shape)
    counts: Counter = Counter()
    for start in range(0, RUNS, BATCH):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i, params.min_p)
            for i in range(BATCH)
        ]
        results = engine.generate(
            [PROMPT] * BATCH, max_new_tokens=DEPTH, state=state, sampling=sampling
        )
        counts.update(tuple(r.token_ids) for r in results)
    return counts


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sampled_trees_match_the_target_distribution(pair, shape) -> None:  # noqa: F811
    counts = tree_samples(*pair, PARAMS[0], shape)
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) > 1e-3


@pytest.mark.parametrize("params", PARAMS[1:], ids=["t0.8-k4-p0.9", "t0.7-p0.95-minp0.05"])
def test_sampled_trees_keep_every_warp(pair, params) -> None:  # noqa: F811
    counts = tree_samples(*pair, params, SHAPES[0])
    assert fit_pvalue(counts, exact_joint(pair[0], params)) > 1e-3


def test_accept_every_first_child_fails_the_same_test(pair, monkeypatch) -> None:  # noqa: F811
    real = accept_module.accept_trees

    def first_child(p, tokens, parents, u):
        u = u.clone()
        u[:, 1:] = 0.0  # accepts any child with mass; the last token drawn as before
        return real(p, tokens, parents, u)

    monkeypatch.setattr(accept_module, "accept_trees", first_child)
    counts = tree_samples(*pair, PARAMS[0], SHAPES[0])
    assert fit_pvalue(counts, exact_joint(pair[0], PARAMS[0])) < 1e-6
