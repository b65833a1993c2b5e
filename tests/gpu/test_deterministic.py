"""The batch-invariant mode (`--deterministic`): a request's tokens do not depend on the batch.

Target alone: the same prompts (mixed lengths) decoded one at a time, 8 and 32 at a time, and
joining a running batch at staggered rounds give identical tokens, greedy and seeded sampling.
Speculative at tiers 1 / 3 / 7: greedy tokens identical to the target alone's at batch 1, 8
and 32 (trees are refused in the mode: tests/unit/test_deterministic_config.py). The negative
control: the default mode, same comparison, differs at least once (a random model's bf16 logits
hold near-ties that the batch's reduction order flips).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from specpair.models.tiny import make_tiny_eagle, make_tiny_llama
from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.gpu.tree_attention import INVARIANT_CHUNK, invariant_tree_config, tree_config
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
NEW = 40
MAX_LEN = 600  # chunks of 256: a request crosses a chunk boundary while it decodes
SHAPE = dict(
    hidden_size=1024,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=2816,
    vocab_size=2048,
    init_std=0.05,
)
GREEDY = SamplingParams()
ALONE = TreeShape(0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deterministic")
    target = make_tiny_llama(root / "target", seed=7, num_layers=4, tokenizer=False, **SHAPE)  # type: ignore[arg-type]
    return {"target": target, "eagle": make_tiny_eagle(root / "eagle", target, seed=8)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 300, (32,), generator=gen).tolist()
    return [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in lengths]


def setup(ckpts: dict[str, Path], deterministic: bool) -> tuple[TargetWorker, dict, object]:
    gc.collect()
    worker = build_target(
        ckpts["target"],
        max_requests=32,
        max_len=MAX_LEN,
        keep_features=True,
        dtype=BF16,
        device="cuda",
        deterministic=deterministic,
    )
    drafter = build_drafter(
        ckpts["eagle"],
        target_path=ckpts["target"],
        max_requests=32,
        max_len=MAX_LEN,
        dtype=BF16,
        device="cuda",
    )
    tiers = [ALONE, *map(TreeShape, (1, 3, 7))]
    return worker, build_states(tiers, worker, drafter), drafter


def alone(
    worker: TargetWorker,
    state: SpecRuntimeState,
    prompts: list[list[int]],
    joins: list[int],
    sampling: list[SamplingParams],
) -> list[list[int]]:
    """The target alone, as the scheduler runs it: prompt i joins the running batch at round
    joins[i] (its own prefill), every running request verifies its pending token each round."""
    seqs = [TargetSequence(f"r{i}", p, sampling[i], NEW) for i, p in enumerate(prompts)]
    running: list[TargetSequence] = []
    round_ = 0
    while round_ <= max(joins) or running:
        new = [s for s, j in zip(seqs, joins, strict=True) if j == round_]
        if new:
            worker.prefill(new)
            running += [s for s in new if s.finish_reason is None]
        if running:
            worker.verify(running, [EMPTY_TREE] * len(running), state)
            running = [s for s in running if s.finish_reason is None]
        round_ += 1
    for s in seqs:
        worker.release(s)
    return [s.output for s in seqs]


def batches(n: int, size: int, stagger: int = 0) -> list[int]:
    """Join rounds: `size` requests at a time, the next group once the last one finished
    (static batches), or with `stagger` > 0 one request every `stagger` rounds."""
    if stagger:
        return [i * stagger for i in range(n)]
    return [(i // size) * (NEW + 1) for i in range(n)]


def test_invariant_chunks_sit_at_fixed_key_positions() -> None:
    config = invariant_tree_config(2056)
    assert config.chunk == INVARIANT_CHUNK == 256 and config.splits == 16
    assert not config.prefetch and invariant_tree_config(256).splits == 1
    # the default config follows the batch: what the mode removes
    assert tree_config(1, 8, 1).splits != tree_config(32, 8, 1).splits


def differences(runs: list[list[list[int]]]) -> int:
    return sum(any(r[i] != runs[0][i] for r in runs[1:]) for i in range(len(runs[0])))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_target_alone_is_the_same_in_any_batch(ckpts, prompts, sampled: bool) -> None:
    worker, states, _ = setup(ckpts, deterministic=True)
    sampling = [
        SamplingParams(0.8, 0.95, 0, seed=i) if sampled else GREEDY for i in range(len(prompts))
    ]
    n = len(prompts)
    runs = [
        alone(worker, states[ALONE], prompts, joins, sampling)
        for joins in (batches(n, 1), batches(n, 8), batches(n, 32), batches(n, 32, stagger=3))
    ]
    assert all(len(out) == NEW for out in runs[0])
    assert differences(runs) == 0, "a request's tokens changed with the batch around it"


def test_greedy_speculation_gives_the_target_alones_tokens_at_every_tier_and_batch(
    ckpts, prompts
) -> None:
    worker, states, drafter = setup(ckpts, deterministic=True)
    n = len(prompts)
    reference = alone(worker, states[ALONE], prompts, batches(n, 1), [GREEDY] * n)
    engine = SpeculativeEngine(worker, drafter)
    accepted = 0
    for tier in map(TreeShape, (1, 3, 7)):
        for size in (1, 8, 32):
            out: list[list[int]] = []
            for lo in range(0, n, size):
                results = engine.generate(
                    prompts[lo : lo + size], max_new_tokens=NEW, state=states[tier]
                )
                out += [r.token_ids for r in results]
                accepted += sum(sum(r.accept_lengths) for r in results)
            bad = [i for i in range(n) if out[i] != reference[i]]
            assert not bad, f"tier {tier}, batch {size}: requests {bad} differ from target alone"
    assert accepted > 0, "no draft was ever accepted: speculation did not run"


def test_the_default_mode_differs_with_the_batch(ckpts, prompts) -> None:
    """The negative control: the same target-alone comparison fails without the mode."""
    worker, states, _ = setup(ckpts, deterministic=False)
    n = len(prompts)
    runs = [
        alone(worker, states[ALONE], prompts, joins, [GREEDY] * n)
        for joins in (batches(n, 1), batches(n, 32))
    ]
    assert differences(runs) > 0, "the default mode never differed: the test cannot fail"
