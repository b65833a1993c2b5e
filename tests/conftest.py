"""Shared fixtures: tiny random checkpoints built on the fly (no network, no shipped weights)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specpair.models.tiny import make_tiny_eagle, make_tiny_llama

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine (CI, or the
# three processes of the end-to-end test) spinning OpenMP workers slow every op by 10-100x.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def hf_greedy(model: Any, ids: list[int], max_new_tokens: int, eos: int = 0) -> list[int]:
    """`transformers`' greedy continuation of `ids` (stopping at `eos`; the shipped and tiny
    tokenizers' <|endoftext|> is 0): the reference speculative decoding must reproduce."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return list(out[0, len(ids) :].tolist())


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "target": make_tiny_llama(root / "target", seed=1),
        "target_b": make_tiny_llama(
            root / "target_b", seed=11, hidden_size=96, num_heads=6, num_kv_heads=3, num_layers=3
        ),
        "draft": make_tiny_llama(root / "draft", seed=2, num_layers=1, hidden_size=32),
        "draft_b": make_tiny_llama(root / "draft_b", seed=12, num_layers=1, hidden_size=48),
        "eagle": make_tiny_eagle(root / "eagle", root / "target", seed=3),
    }
