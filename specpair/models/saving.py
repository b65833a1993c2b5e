"""Write checkpoints in Hugging Face layout, one tensor at a time, in safetensors shards.

A tensor is made on whatever device its maker chooses and moved to the CPU only to be written,
so a Llama-3-8B (16 GB in bf16) never needs a float32 or full CPU copy. config.json is written
last: a directory that has one is complete (`is_written`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpair.models.args import ModelArgs
from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel

SHARD_BYTES = 2 * 2**30
# An EAGLE head reads these from its target's checkpoint; its own stores neither.
EAGLE_SHARED = frozenset({"embed_tokens.weight", "lm_head.weight"})


def hf_config(args: ModelArgs, dtype: torch.dtype, architecture: str) -> dict[str, object]:
    """config.json as the Hub's Llama-3 checkpoints write it (`rope_scaling` + `rope_theta`, which
    transformers v4 reads as is and v5 folds into `rope_parameters`)."""
    if args.qkv_bias != args.o_bias or args.sliding_window is not None:
        raise ValueError("a Llama config.json cannot express Qwen2's biases or a sliding window")
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
        "hidden_act": args.hidden_act,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": dict(args.rope_scaling) or None,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.o_bias,
        "mlp_bias": args.mlp_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def checkpoint_shapes(args: ModelArgs, *, eagle: bool = False) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a checkpoint of `args` stores, in module order: a
    `LlamaForCausalLM` (a tied LM head stored once, as HF does) or a specpair EAGLE head."""
    with torch.device("meta"):
        module = EagleHead(args, args) if eagle else LlamaModel(args)
    skip = EAGLE_SHARED if eagle else frozenset()
    if not eagle and args.tie_word_embeddings:
        skip = frozenset({"lm_head.weight"})
    return {k: v.shape for k, v in module.state_dict().items() if k not in skip}


def is_written(directory: Path, config: Mapping[str, object]) -> bool:
    file = directory / "config.json"
    return file.is_file() and json.loads(file.read_text()) == config


def write_shards(
    directory: Path,
    shapes: Mapping[str, torch.Size],
    config: Mapping[str, object],
    make: Callable[[str], torch.Tensor],
    *,
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes tensor `name` = `make(name)` (cast to `dtype`) for every name of `shapes`, in
    `model-0000i-of-0000n.safetensors` shards of at most `shard_bytes`, with the index file."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [directory / "config.json", *directory.glob("*.safetensors")]:
        stale.unlink(missing_ok=True)  # the loader reads every shard in the directory
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
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    # One thread writes file i (safetensors releases the GIL) while this one builds file i + 1:
    # at most two files' tensors are on the host at once.
    with ThreadPoolExecutor(max_workers=1) as writer:
        writing: tuple[Future[None], str, float] | None = None
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name in names:
                tensor = make(name)
                if tensor.shape != shapes[name]:
                    raise ValueError(f"{name}: made {tuple(tensor.shape)}, expected {shapes[name]}")
                if tensor.is_floating_point():  # an index map (EAGLE-3's d2t, t2d) keeps its type
                    tensor = tensor.to(dtype)
                tensors[name] = tensor.cpu().contiguous()
                weight_map[name] = file
            if writing is not None:
                _written(writing, directory, t0, progress)
            gib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
            done = writer.submit(save_file, tensors, str(directory / file), {"format": "pt"})
            writing = (done, file, gib)
        if writing is not None:
            _written(writing, directory, t0, progress)
    total = sum(s.numel() * itemsize for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _written(
    writing: tuple[Future[None], str, float],
    directory: Path,
    t0: float,
    progress: Callable[[str], None] | None,
) -> None:
    done, file, gib = writing
    done.result()  # raises the writer's error
    if progress is not None:
        progress(f"{directory.name}/{file}: {gib:.2f} GiB, {time.perf_counter() - t0:.0f} s")
