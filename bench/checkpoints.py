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
from torch import nn

from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel, ModelArgs
from specpair.models.loading import EAGLE_ARCHITECTURE
from specpair.models.saving import SHARD_BYTES, hf_config, is_written, write_shards

# The EAGLE head reads these from the target checkpoint.
EAGLE_SHARED = frozenset({"embed_tokens.weight", "lm_head.weight"})


def write_random(
    directory: Path,
    module: nn.Module,
    config: dict[str, object],
    *,
    seed: int,
    device: str,
    dtype: torch.dtype,
    skip: frozenset[str] = frozenset(),
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes `module`'s state dict (less `skip`) as random weights; `module` may be on "meta"."""
    shapes = {k: v.shape for k, v in module.state_dict().items() if k not in skip}
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
    with torch.device("meta"):
        model = LlamaModel(args)
    skip = frozenset({"lm_head.weight"}) if args.tie_word_embeddings else frozenset()
    return write_random(
        directory, model, config, seed=seed, device=device, dtype=dtype, skip=skip,
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
    with torch.device("meta"):
        head = EagleHead(args, target_args)
    return write_random(
        directory, head, config, seed=seed, device=device, dtype=dtype, skip=EAGLE_SHARED,
        progress=progress,
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
