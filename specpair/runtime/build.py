"""Assemble the in-process pieces from checkpoint paths (engine demo, tests, benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch

from specpair.models.loading import is_eagle_checkpoint, load_eagle, load_llama
from specpair.runtime.draft import Drafter, EagleDrafter, LMDrafter
from specpair.runtime.kv_cache import DenseKVCache
from specpair.runtime.target import TargetWorker


def build_target(
    path: str | Path,
    *,
    max_requests: int,
    max_len: int,
    keep_features: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> TargetWorker:
    model = load_llama(path, dtype=dtype, device=device)
    cache = DenseKVCache.for_model(
        model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )
    return TargetWorker(model, cache, keep_features=keep_features)


def build_drafter(
    path: str | Path,
    *,
    target_path: str | Path | None,
    max_requests: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Drafter:
    """An EAGLE drafter when `path` is an EAGLE head (needs `target_path`), else a standalone LM."""
    if is_eagle_checkpoint(path):
        if target_path is None:
            raise ValueError(f"{path} is an EAGLE head: the target checkpoint path is required")
        head = load_eagle(path, target_path, dtype=dtype, device=device)
        cache = DenseKVCache.for_model(
            head.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
        return EagleDrafter(head, cache)
    model = load_llama(path, dtype=dtype, device=device)
    cache = DenseKVCache.for_model(
        model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )
    return LMDrafter(model, cache)
