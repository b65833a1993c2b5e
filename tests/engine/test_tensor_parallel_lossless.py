"""A tensor-parallel target (TP = 2: this process is rank 0, one follower process, gloo)
computes what the target in one process computes: the same logits (float32, to rounding),
greedy tokens equal to `transformers`' generate with and without drafts, and speculative
sampling in the target's exact distribution (chi-square, as `test_sampling_lossless.py`), a
TP target that loses the other rank's partial sums failing the same test.

The target has biases everywhere (column-parallel ones are split, row-parallel ones added
once) and an odd vocabulary (the last rank's LM head rows are padding).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from scipy.stats import chisquare
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

import specpair.models.parallel as parallel_module
from specpair.models.tiny import make_tiny_family, make_tiny_llama
from specpair.parallel.build import build_parallel_target
from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams, warp
from specpair.runtime.target.worker import TargetWorker
from tests.engine.test_greedy_lossless import hf_greedy

VOCAB = 7
PROMPTS = [[1, 4, 2], [3, 5, 6, 0, 2, 1, 4, 4, 3], [6]]
NEW_TOKENS = 16
SAMPLE_PROMPT, DEPTH, RUNS, BATCH = [1, 4, 2], 3, 4096, 256
MAX_LEN = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp")
    target = make_tiny_family(
        root / "target",
        LlamaConfig,
        LlamaForCausalLM,
        seed=31,
        vocab_size=VOCAB,
        attention_bias=True,
        mlp_bias=True,
        initializer_range=0.3,
    )
    draft = make_tiny_llama(
        root / "draft", seed=32, vocab_size=VOCAB, num_layers=1, init_std=0.3, tokenizer=False
    )
    return target, draft


@pytest.fixture(scope="module")
def tp2(models: tuple[Path, Path]) -> Iterator[TargetWorker]:
    worker, ranks = build_parallel_target(
        models[0], tensor_parallel=2, max_requests=BATCH, max_len=MAX_LEN
    )
    yield worker
    ranks.stop()


@pytest.fixture(scope="module")
def tp1(models: tuple[Path, Path]) -> TargetWorker:
    return build_target(models[0], max_requests=BATCH, max_len=MAX_LEN)


def generate(
    worker: TargetWorker,
    draft: Path | None,
    tier: int,
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams] | None = None,
    new_tokens: int = NEW_TOKENS,
) -> list[list[int]]:
    drafter = None
    if draft is not None:
        drafter = build_drafter(draft, target_path=None, max_requests=BATCH, max_len=MAX_LEN)
    state = build_states([tier], worker, drafter)[tier]
    results = SpeculativeEngine(worker, drafter).generate(
        prompts, max_new_tokens=new_tokens, state=state, sampling=sampling or SamplingParams()
    )
    return [r.token_ids for r in results]


def spy_logits(worker: TargetWorker, monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Every logits tensor the worker's model computes from now on (prefill and verify)."""
    seen: list[Tensor] = []
    logits = worker.model.logits

    def spy(hidden: Tensor) -> Tensor:
        seen.append(out := logits(hidden))
        return out

    monkeypatch.setattr(worker.model, "logits", spy)
    return seen


def test_logits_equal_one_process(models, tp1, tp2, monkeypatch) -> None:
    """Prefill and tier-3 verifies with an unrelated draft (trees partly rejected, so commits
    keep a prefix and the next tree overwrites the rest): every logits tensor, both ways."""
    one, two = spy_logits(tp1, monkeypatch), spy_logits(tp2, monkeypatch)
    assert generate(tp2, models[1], 3, PROMPTS) == generate(tp1, models[1], 3, PROMPTS)
    assert len(one) == len(two) > 2 and any(x.shape[1] == 4 for x in one[1:])
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("draft", "tier"), [(None, 0), ("draft", 1), ("draft", 3), ("target", 3)])
def test_greedy_equals_transformers(models, tp2, draft, tier) -> None:
    path = {None: None, "draft": models[1], "target": models[0]}[draft]
    expected = [hf_greedy(models[0], p, NEW_TOKENS) for p in PROMPTS]
    assert generate(tp2, path, tier, PROMPTS) == expected


def exact_joint(target: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    model = LlamaForCausalLM.from_pretrained(target).eval()
    outcomes = list(itertools.product(range(VOCAB), repeat=DEPTH))
    ids = torch.tensor([SAMPLE_PROMPT + list(o) for o in outcomes])
    with torch.no_grad():
        logits = model(ids).logits[:, len(SAMPLE_PROMPT) - 1 : -1]
    picked = warp(logits, params).gather(-1, ids[:, len(SAMPLE_PROMPT) :, None])[..., 0]
    return {o: float(p) for o, p in zip(outcomes, picked.prod(-1), strict=True)}


def sample(worker: TargetWorker, draft: Path, params: SamplingParams, runs: int = RUNS) -> Counter:
    counts: Counter = Counter()
    for start in range(0, runs, BATCH):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i)
            for i in range(BATCH)
        ]
        out = generate(worker, draft, DEPTH, [SAMPLE_PROMPT] * BATCH, sampling, DEPTH)
        counts.update(map(tuple, out))
    return counts


def fit_pvalue(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    total = sum(counts.values())
    big = [o for o, p in expected.items() if p * total >= 5]
    observed = [counts[o] for o in big] + [total - sum(counts[o] for o in big)]
    exp = [expected[o] * total for o in big] + [total * (1 - sum(expected[o] for o in big))]
    scale = sum(observed) / sum(exp)
    return float(chisquare(observed, [e * scale for e in exp]).pvalue)


PARAMS = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_distribution(models, tp2) -> None:
    counts = sample(tp2, models[1], PARAMS)
    assert fit_pvalue(counts, exact_joint(models[0], PARAMS)) > 1e-3


@pytest.mark.slow
def test_losing_the_other_ranks_partial_sums_fails_the_same_test(models, tp2, monkeypatch) -> None:
    """Rank 0 still takes part in each all-reduce (the follower must not hang) but keeps its
    own partial sum: its layers see half of every attention and MLP output."""

    def own_part_only(x: Tensor) -> Tensor:
        dist.all_reduce(x.clone())
        return x

    monkeypatch.setattr(parallel_module, "reduce_sum", own_part_only)
    counts = sample(tp2, models[1], PARAMS, RUNS // 2)  # p was 0.0 at 2048 runs
    assert fit_pvalue(counts, exact_joint(models[0], PARAMS)) < 1e-6
