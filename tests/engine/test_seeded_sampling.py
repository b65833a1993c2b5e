"""A seed gives the same tokens alone and inside a batch: each request's draws come from its own
generators (the target's and the draft's), one uniform per draw, whatever rows run beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.sampling import SamplingParams

PROMPTS = [[5 + i, 6, 7 + 2 * i, 100 - i][: 2 + i % 3] for i in range(8)]  # mixed lengths
SAMPLING = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(8)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("seeded")
    return (
        make_tiny_llama(root / "target", seed=1),
        make_tiny_llama(root / "draft", seed=2, num_layers=1, hidden_size=32),
    )


@pytest.mark.parametrize("tier", [0, 1, 3])
def test_a_seed_gives_the_same_tokens_at_batch_1_and_in_a_batch_of_8(pair, tier: int) -> None:
    """Tier 0: the target alone. (On the CPU in float32 the logits of a row do not depend on
    the batch; on a GPU in bf16 they do, which is what a batch-invariant mode is for.)"""
    target, draft = pair
    worker = build_target(target, max_requests=8, max_len=96)
    drafter = build_drafter(draft, target_path=None, max_requests=8, max_len=96)
    state = build_states([max(tier, 1)], worker, drafter)[max(tier, 1)]
    engine = SpeculativeEngine(worker, drafter if tier else None)

    def run(group: list[int]) -> list[list[int]]:
        results = engine.generate(
            [PROMPTS[i] for i in group],
            max_new_tokens=24,
            state=state,
            sampling=[SAMPLING[i] for i in group],
        )
        return [r.token_ids for r in results]

    together = run(list(range(8)))
    assert [run([i])[0] for i in range(8)] == together
    assert len({tuple(t) for t in together}) == 8  # the seeds drew different samples
