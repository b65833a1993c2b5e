"""Assemble the in-process pieces from checkpoint paths (engine demo, tests, benchmarks).

On a CUDA device the model is fused (`fused.py`); the cache is the same paged cache on every
device. Build the workers first, then the states with them (`StateBuilder(worker, drafter)`,
which captures CUDA graphs for a GPU worker), as the services do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specpair.models.eagle3_loading import aux_layers, load_eagle3
from specpair.models.llama import ModelArgs
from specpair.models.loading import (
    CheckpointError,
    eagle_layout,
    load_eagle,
    load_llama,
    read_args,
)
from specpair.runtime.draft import Drafter
from specpair.runtime.drafters import EagleDrafter, LMDrafter
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.target import TargetWorker

# No fused layer or CUDA graphs for EAGLE-3 yet: refused on a GPU rather than half-served.
EAGLE3_ON_CPU = "EAGLE-3 drafting is served on the CPU only for now (--device cpu)"


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def make_cache(
    args: ModelArgs, *, max_requests: int, max_len: int, dtype: torch.dtype, device: str
) -> KVCache:
    return KVCache.for_model(
        args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )


def gpu_target(worker: TargetWorker) -> TargetWorker:
    """Fuses the target's decoder for the GPU."""
    from specpair.runtime.fused import fuse_decoder

    fuse_decoder(worker.model)
    return worker


def gpu_drafter(drafter: Drafter) -> Drafter:
    """Fuses the drafter's decoder (an EAGLE head's layer, or the LM) for the GPU."""
    from specpair.runtime.fused import fuse_decoder

    if isinstance(drafter, EagleDrafter):
        fuse_decoder(drafter.head)
    elif isinstance(drafter, LMDrafter):
        fuse_decoder(drafter.model)
    return drafter


def build_target(
    path: str | Path,
    *,
    max_requests: int,
    max_len: int,
    keep_features: bool = False,
    feature_layers: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> TargetWorker:
    """`feature_layers`: an EAGLE-3 draft's (`eagle3_loading.aux_layers`). Such a target is
    refused on a GPU: its fused layers defer their residual add and its verify graphs return
    only the final hidden state."""
    if feature_layers and _is_cuda(device):
        raise CheckpointError(f"{path}: {EAGLE3_ON_CPU} (feature layers {list(feature_layers)})")
    model = load_llama(path, dtype=dtype, device=device, context=max_len)
    cache = make_cache(
        model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
    )
    worker = TargetWorker(model, cache, keep_features=keep_features, feature_layers=feature_layers)
    return gpu_target(worker) if _is_cuda(device) else worker


def feature_layers(draft_path: str | Path, target_path: str | Path) -> tuple[int, ...]:
    """The target layers whose outputs an EAGLE-3 draft reads; () for any other draft (an
    EAGLE-1/2 head reads the final hidden state, a draft LM nothing)."""
    if eagle_layout(draft_path) != "eagle3":
        return ()
    return aux_layers(draft_path, read_args(target_path).num_layers)


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
    layout = eagle_layout(path)
    if layout is not None:
        if target_path is None:
            raise CheckpointError(f"{path}: an EAGLE head; the target checkpoint path is required")
        if layout == "eagle3" and _is_cuda(device):
            raise CheckpointError(f"{path}: an EAGLE-3 head; {EAGLE3_ON_CPU}")
        load = load_eagle3 if layout == "eagle3" else load_eagle
        head = load(path, target_path, dtype=dtype, device=device, context=max_len)
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
    return gpu_drafter(drafter) if _is_cuda(device) else drafter
