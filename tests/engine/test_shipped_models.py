"""The shipped pair (models/): speculative greedy output equals transformers' greedy generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from specpair.config import MODELS_DIR
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from tests.conftest import hf_greedy

TARGET = MODELS_DIR / "target"
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "The history of the bicycle begins in the early nineteenth century, when",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompts, reference = [], []
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False)
        prompts.append(ids)
        reference.append(hf_greedy(model, ids, NEW_TOKENS))
    return prompts, reference


@pytest.mark.parametrize("draft", ["draft", "eagle", "eagle3"])
@pytest.mark.parametrize("tier", [3, 7])
def test_shipped_pair_is_lossless(prompts_and_reference, draft: str, tier: int) -> None:
    prompts, reference = prompts_and_reference
    layers = feature_layers(MODELS_DIR / draft, TARGET)  # the EAGLE-3 head's: (1, 2, 4)
    assert (draft == "eagle3") == (layers == (1, 2, 4))
    worker = build_target(
        TARGET, max_requests=len(prompts), max_len=512, keep_features=True, feature_layers=layers
    )
    drafter = build_drafter(
        MODELS_DIR / draft, target_path=TARGET, max_requests=len(prompts), max_len=512
    )
    results = SpeculativeEngine(worker, drafter).generate(
        prompts,
        max_new_tokens=NEW_TOKENS,
        state=build_states([tier], worker, drafter)[tier],
        stop_token_ids=frozenset({0}),
    )
    assert [r.token_ids for r in results] == reference
    accepts = [a for r in results for a in r.accept_lengths]
    # a trained pair accepts far more than the ~0 of unrelated weights
    assert sum(accepts) / len(accepts) > 1.0


def test_shipped_checkpoints_fit_the_budget() -> None:
    total = sum(p.stat().st_size for p in Path(MODELS_DIR).rglob("*") if p.is_file())
    assert total <= 32_000_000
