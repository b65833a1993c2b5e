"""Grow a trained Llama (or EAGLE head) into a bigger shape that computes the same function.

A benchmark then pays a big model's memory traffic while accepting drafts at the rate the small
trained pair really achieves:

    python -m training.grow models/target /tmp/grown/target --shape llama3-8b
    python -m training.grow models/eagle  /tmp/grown/eagle  --shape llama3-8b
    python -m training.grow models/eagle3 /tmp/grown/eagle3 --shape llama3-8b  # grow_eagle3.py
    python -m training.grow models/draft  /tmp/grown/draft  --shape llama3.2-1b
    python -m training.grow SRC DST --hidden 512 --layers 8 --heads 16 --kv-heads 4 \\
        --head-dim 128 --intermediate 2048 --vocab 8448
    python -m training.grow models/target /tmp/t70 --shape llama3-70b --device cuda
    python -m training.grow models/eagle3 /tmp/t70-eagle3 --shape llama3-70b --device cuda

(Explicit flags without --shape keep the small model's tied embedding; --tied no unties.)

Memory and time: the tensors are built on --device one decoder layer at a time and written in
files of at most 2 GiB, one thread writing a file while the next is built, so the host holds
at most two files' tensors (plus, with --device cpu, the float32 embedding being built), never
the model: llama3-70b is 131 GiB in bf16 (about 70 files). On the CPU the build dominates (randn,
casts): 2 cores wrote 3.55 GiB in 40 s (61 s with the write not overlapped), hours for 70B.
With --device cuda the build is GPU work and the time is the device-to-host copy and the
writes; safetensors wrote 0.64 GiB/s on that 2-core machine, about 3.5 min for 131 GiB, and
a GPU host's disk is likely faster (not measured there).

The construction (small h, d, … → big H, D, …), exact up to float rounding:
- hidden: small dims stay at [0, h); padded residual dims hold 0, except dim P = h, which every
  token's embedding sets to a constant c (below). Norm weights × sqrt(h/H) and eps × h/H keep
  RMSNorm's statistics: mean_H(x²) + eps' = (h/H)(mean_h(x²) + eps) once eps' absorbs c²:
  eps' = (eps·h − c²)/H, with c² = eps·h/2.
- head_dim d → D under RoPE: small rotary pair i (dims i, i + d/2) goes to big pair m·i (dims
  m·i, m·i + D/2), m = D // d, with rope_theta' = rope_theta ** (D / (m·d)) so that big pair m·i
  turns at small pair i's frequency; q × sqrt(D/d) undoes the 1/sqrt(D) softmax scale. v keeps
  dims [0, d). Example d 40 → D 128: m = 3, θ' = 10000^(16/15); d 32 → 64: m = 2, θ' = θ.
- GQA: each small kv group gets ceil(r_small / r_big) big kv groups holding copies of its k and
  v; its q heads fill those groups' q heads in order.
- extra heads, MLP units and layers: output projections (o, down) zero, inputs random, so each
  costs what it would in a real model and adds exactly 0 to the residual.
- extra vocab rows: a zero row would give logit 0, and the small models' logits are small (on
  held-out code the target's largest logit is as low as 3.5): 120k zero-logit tokens would take
  over 99 % of the mass under sampling. So every padded token's LM-head row reads only dim P,
  with weight −PAD_WEIGHT: the final norm turns the constant c into c·w/rms > 0, so its logit
  is always negative and far below the real ones (checked on held-out text in the tests). Real
  rows read 0 at P, so real logits are unchanged; a tied model's embedding carries c at P, which
  shifts all real logits of a position by the same amount (softmax unchanged). Layer norms
  weight dim P by 0, so no projection sees it.
- EAGLE head: fc's two input halves land at [0, h) and [H, H + h); fc copies the embedding's
  constant into its own dim P, so the head's prediction carries c there and its padded logits
  are −PAD_WEIGHT·c.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from specpair.models.loading import eagle_layout, read_args, read_tensors
from specpair.models.saving import SHARD_BYTES, checkpoint_shapes, write_shards
from training.grow_eagle3 import eagle3_tensors
from training.growth import SHAPES, Growth, Shape, big_args

__all__ = ["SHAPES", "Growth", "Shape", "grow"]  # what callers import from here

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def grown_tensors(
    growth: Growth, small: dict[str, Tensor], *, eagle: bool
) -> tuple[dict[str, torch.Size], Callable[[str], Tensor]]:
    """(name -> shape, make(name)) of the grown checkpoint; layers are built on demand, in
    module order, so only one big layer is alive at a time."""
    big = growth.big
    prefix = "layers." if eagle else "model.layers."
    small_layers = growth.small.num_layers
    cached: dict[int, dict[str, Tensor]] = {}

    def layer(i: int) -> dict[str, Tensor]:
        if i not in cached:
            cached.clear()
            own = f"{prefix}{i}."
            part = {k[len(own) :]: v for k, v in small.items() if k.startswith(own)}
            cached[i] = growth.layer(part if i < small_layers else None)
        return cached[i]

    @functools.cache
    def fc() -> tuple[Tensor, Tensor]:
        return growth.fc(small["fc.weight"], small["fc.bias"])

    def make(name: str) -> Tensor:
        if name.startswith(prefix):
            index, _, key = name[len(prefix) :].partition(".")
            return layer(int(index))[key]
        if name in ("fc.weight", "fc.bias"):
            weight, bias = fc()  # built once for both
            return bias if name == "fc.bias" else weight
        if name == "model.norm.weight":
            return growth.norm(small["model.norm.weight"], final=True)
        embed = small["model.embed_tokens.weight"]
        if name == "model.embed_tokens.weight":
            return growth.embedding(embed, lm_head=big.tie_word_embeddings)
        return growth.embedding(small.get("lm_head.weight", embed), lm_head=True)

    return checkpoint_shapes(big, eagle=eagle), make


def grown_config(src: Path, growth: Growth, dtype: torch.dtype) -> dict[str, object]:
    """The small config.json with the big shape, eps and rope theta (other fields kept)."""
    config = json.loads((src / "config.json").read_text())
    big = growth.big
    theta = growth.rope_theta()
    config.update(
        vocab_size=big.vocab_size,
        hidden_size=big.hidden_size,
        intermediate_size=big.intermediate_size,
        num_hidden_layers=big.num_layers,
        num_attention_heads=big.num_heads,
        num_key_value_heads=big.num_kv_heads,
        head_dim=big.head_dim,
        rms_norm_eps=growth.eps(dtype),
        tie_word_embeddings=big.tie_word_embeddings,
        dtype=str(dtype).removeprefix("torch."),
    )
    config.pop("torch_dtype", None)
    if "rope_theta" in config or "rope_parameters" not in config:
        config["rope_theta"] = theta
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": theta}
    config["specpair_grown_from"] = {
        "path": str(src),
        "hidden_size": growth.small.hidden_size,
        "head_dim": growth.small.head_dim,
        "vocab_size": growth.small.vocab_size,
        "rope_pair_stride": growth.m,
        "constant_dim": growth.pad_dim,
        "constant": growth.const,
    }
    return config


def grow(
    src: Path,
    dst: Path,
    shape: Shape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes the grown checkpoint of `src` (a Llama or an EAGLE head) at `dst`, in files of
    at most `shard_bytes`."""
    layout = eagle_layout(src)
    eagle = layout is not None
    small_args = read_args(src, allow_eagle=eagle)
    growth = Growth(small_args, big_args(small_args, shape, eagle=eagle), device=device, seed=seed)
    small = {k: v.to(growth.device) for k, v in read_tensors(src).items()}
    if layout == "eagle3":
        names, make = eagle3_tensors(growth, small)
    else:
        names, make = grown_tensors(growth, small, eagle=eagle)
    config = grown_config(src, growth, dtype)
    if layout == "eagle3":
        config["draft_vocab_size"] = names["lm_head.weight"][0]
    write_shards(dst, names, config, make, dtype=dtype, shard_bytes=shard_bytes, progress=progress)
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


FIELDS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path, help="small checkpoint (Llama or specpair EAGLE head)")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named big shape")
    for field in FIELDS:
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, help="(overrides --shape)")
    parser.add_argument("--tied", choices=["yes", "no"], help="tie embeddings (default: shape's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="where tensors are built (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Shape:
    """--shape's fields, each overridden by its flag; without --shape every flag is needed."""
    base = SHAPES[args.shape] if args.shape else None
    values = {}
    for field in FIELDS:
        value = getattr(args, field)
        if value is None and base is None:
            parser.error(f"--{field.replace('_', '-')} is required without --shape")
        values[field] = value if value is not None else getattr(base, field)
    tied = base.tied if base else None
    if args.tied:
        tied = args.tied == "yes"
    return Shape(**values, tied=tied)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    shape = parse_shape(parser, args)
    t0 = time.perf_counter()
    try:
        grow(
            args.src,
            args.dst,
            shape,
            dtype=getattr(torch, args.dtype),
            device=args.device,
            seed=args.seed,
            progress=lambda m: print(f"  {m}", flush=True),
        )
    except ValueError as e:
        parser.error(str(e))
    print(f"{args.src} -> {args.dst} ({shape}) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
