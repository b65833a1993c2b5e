"""Assemble the in-process pieces from checkpoint paths (engine demo, tests, benchmarks).

On a CUDA device the model is fused (`fused.py`), the cache is paged (flashinfer) and the
worker gets its CUDA-graph builder (`worker.graphs`): build the workers first, then the states
with them (`build_states(tiers, [worker, drafter])`), as the services do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specpair.models.llama import ModelArgs
from specpair.models.loading import (
    CheckpointError,
    is_eagle_checkpoint,
    load_eagle,
    load_llama,
)
from specpair.runtime.draft import Drafter, EagleDrafter, LMDrafter
from specpair.runtime.kv_cache import DenseKVCache, KVCache
from specpair.runtime.target import TargetWorker


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def make_cache(
    args: ModelArgs, *, max_requests: int, max_len: int, dtype: torch.dtype, device: str
) -> KVCache:
    if _is_cuda(device):
        from specpair.runtime.paged_kv import PagedKVCache

        return PagedKVCache.for_model(
            args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
    return DenseKVCache.for_model(
        args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )


def gpu_target(
    worker: TargetWorker, max_batch: int, buckets: list[int] | None = None
) -> TargetWorker:
    """Fuses the model and gives the worker its verify-graph builder (`build_states`)."""
    from specpair.runtime.cuda_graphs import TargetGraphs
    from specpair.runtime.fused import fuse_decoder

    fuse_decoder(worker.model)
    worker.graphs = TargetGraphs(worker, max_batch, buckets)
    return worker


def gpu_drafter(drafter: Drafter, max_batch: int, buckets: list[int] | None = None) -> Drafter:
    from specpair.runtime.cuda_graphs import DraftGraphs
    from specpair.runtime.fused import fuse_decoder

    fuse_decoder(drafter.head if isinstance(drafter, EagleDrafter) else drafter.model)  # type: ignore[attr-defined]
    drafter.graphs = DraftGraphs(drafter, max_batch, buckets)
    return drafter


def build_target(
    path: str | Path,
    *,
    max_requests: int,
    max_len: int,
    keep_features: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> TargetWorker:
    model = load_llama(path, dtype=dtype, device=device, context=max_len)
    cache = make_cache(
        model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )
    worker = TargetWorker(model, cache, keep_features=keep_features)
    return gpu_target(worker, max_requests) if _is_cuda(device) else worker


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
    drafter: Drafter
    if is_eagle_checkpoint(path):
        if target_path is None:
            raise CheckpointError(f"{path}: an EAGLE head; the target checkpoint path is required")
        head = load_eagle(path, target_path, dtype=dtype, device=device, context=max_len)
        cache = make_cache(
            head.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
        drafter = EagleDrafter(head, cache)
    else:
        model = load_llama(path, dtype=dtype, device=device, context=max_len)
        cache = make_cache(
            model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
        drafter = LMDrafter(model, cache)
    return gpu_drafter(drafter, max_requests) if _is_cuda(device) else drafter
