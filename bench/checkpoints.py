"""Random-weight checkpoints of any Llama shape (and an EAGLE head for it), in Hugging Face layout.

Unlike `specpair.models.tiny`, which builds a `transformers` model in float32 on the CPU, tensors
here are drawn one at a time on the chosen device in the checkpoint dtype (std 0.02, norms 1) and
written in shards (`specpair.models.saving`). Names and shapes come from specpair's own modules,
so the loader accepts exactly what is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from specpair.models.args import ModelArgs
from specpair.models.loading import EAGLE_ARCHITECTURE
from specpair.models.saving import (
    SHARD_BYTES,
    checkpoint_shapes,
    hf_config,
    is_written,
    write_shards,
)


def write_random(
    directory: Path,
    shapes: dict[str, torch.Size],
    config: dict[str, object],
    *,
    seed: int,
    device: str,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes random weights of `shapes` (`checkpoint_shapes`)."""
    gen = torch.Generator(device).manual_seed(seed)

    def make(name: str) -> torch.Tensor:
        t = torch.empty(shapes[name], dtype=dtype, device=device)
        # Same rule as bench.gpu_common's in-memory models: norms 1, the rest N(0, 0.02).
        return t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=gen)

    return write_shards(
        directory, shapes, config, make, dtype=dtype, shard_bytes=shard_bytes, progress=progress
    )


def write_llama(
    directory: Path,
    args: ModelArgs,
    *,
    seed: int = 1,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """A random `LlamaForCausalLM` of shape `args` (tied embeddings stored once, as HF does);
    one already complete at `directory` with the same config is kept."""
    config = hf_config(args, dtype, "LlamaForCausalLM")
    if is_written(directory, config):
        return directory
    return write_random(
        directory, checkpoint_shapes(args), config, seed=seed, device=device, dtype=dtype,
        shard_bytes=shard_bytes, progress=progress,
    )  # fmt: skip


def write_eagle(
    directory: Path,
    target_args: ModelArgs,
    *,
    seed: int = 2,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """An EAGLE head at the target's width (fc + one decoder layer); embedding and LM head are
    the target's, so they are not written. One already complete at `directory` is kept."""
    args = replace(target_args, num_layers=1)
    config = hf_config(args, dtype, EAGLE_ARCHITECTURE)
    if is_written(directory, config):
        return directory
    return write_random(
        directory, checkpoint_shapes(args, eagle=True), config, seed=seed, device=device,
        dtype=dtype, progress=progress,
    )  # fmt: skip


def random_pair(
    root: Path,
    args: ModelArgs,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, Path]:
    """(target, EAGLE head) as `root`/target and `root`/eagle, reusing complete ones there."""
    target = write_llama(root / "target", args, device=device, dtype=dtype,
                         shard_bytes=shard_bytes, progress=progress)  # fmt: skip
    return target, write_eagle(root / "eagle", args, device=device, dtype=dtype, progress=progress)
