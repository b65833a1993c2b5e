"""Random-weight checkpoints of any Llama shape (and an EAGLE head for it), in Hugging Face layout.

Unlike `specpair.models.tiny`, which builds a `transformers` model in float32 on the CPU, tensors
here are drawn one at a time on the chosen device in the checkpoint dtype (std 0.02, norms 1) and
written in shards, so a Llama-3-8B (16 GB in bf16) never needs a float32 or full CPU copy. Names
and shapes come from specpair's own modules, so the loader accepts exactly what is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel, ModelArgs
from specpair.models.loading import EAGLE_ARCHITECTURE

SHARD_BYTES = 2 * 2**30
# The EAGLE head reads these from the target checkpoint.
EAGLE_SHARED = frozenset({"embed_tokens.weight", "lm_head.weight"})


def hf_config(args: ModelArgs, dtype: torch.dtype, architecture: str) -> dict[str, object]:
    """config.json as the Hub's Llama-3 checkpoints write it (`rope_scaling` + `rope_theta`, which
    transformers v4 reads as is and v5 folds into `rope_parameters`)."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": dict(args.rope_scaling) or None,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


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
    """Writes `module`'s state dict (less `skip`) as random weights; `module` may be on "meta".

    config.json is written last, so a directory that has one is complete (`is_written`).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [directory / "config.json", *directory.glob("*.safetensors")]:
        stale.unlink(missing_ok=True)  # the loader reads every shard in the directory
    shapes = {k: v.shape for k, v in module.state_dict().items() if k not in skip}
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator(device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.empty(shapes[name], dtype=dtype, device=device)
            # Same rule as bench.gpu_common's in-memory models: norms 1, the rest N(0, 0.02).
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = file
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        if progress is not None:
            gib = sum(t.numel() * itemsize for t in tensors.values()) / 2**30
            progress(f"{directory.name}/{file}: {gib:.2f} GiB, {time.perf_counter() - t0:.0f} s")
    total = sum(s.numel() * itemsize for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def is_written(directory: Path, config: dict[str, object]) -> bool:
    file = directory / "config.json"
    return file.is_file() and json.loads(file.read_text()) == config


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
