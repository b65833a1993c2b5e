"""Grow a trained Llama (or EAGLE head) into a bigger shape that computes the same function.

A benchmark then pays a big model's memory traffic while accepting drafts at the rate the small
trained pair really achieves:

    python -m training.grow models/target /tmp/grown/target --shape llama3-8b
    python -m training.grow models/eagle  /tmp/grown/eagle  --shape llama3-8b
    python -m training.grow models/draft  /tmp/grown/draft  --shape llama3.2-1b
    python -m training.grow SRC DST --hidden 512 --layers 8 --heads 16 --kv-heads 4 \\
        --head-dim 128 --intermediate 2048 --vocab 8448

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
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from specpair.models.llama import ModelArgs
from specpair.models.loading import is_eagle_checkpoint, read_args, read_tensors
from specpair.models.saving import checkpoint_shapes, write_shards

PAD_WEIGHT = 2.0**14  # exact in bf16
INIT_STD = 0.02  # the random inputs of extra heads, units and layers
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool | None = None  # None: as the small model


SHAPES = {
    "llama3-8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, tied=False),
    "llama3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, 128256, tied=True),
}


class Growth:
    """Where each small parameter lands in the big shape (index maps and constants)."""

    def __init__(
        self, small: ModelArgs, big: ModelArgs, *, device: str = "cpu", seed: int = 0
    ) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device).manual_seed(seed)
        h, hh = small.hidden_size, big.hidden_size
        d, dd = small.head_dim, big.head_dim
        if small.rope_scaling:
            raise ValueError("growing a model with rope scaling is not supported (default rope)")
        for field, lo, hi in (
            ("hidden", h + 1, hh),  # one padded dim carries the constant
            ("layers", small.num_layers, big.num_layers),
            ("heads", small.num_heads, big.num_heads),
            ("head_dim", d, dd),
            ("intermediate", small.intermediate_size, big.intermediate_size),
            ("vocab", small.vocab_size, big.vocab_size),
        ):
            if hi < lo:
                raise ValueError(f"--{field.replace('_', '-')} {hi}: the small model needs >= {lo}")
        if dd % 2:
            raise ValueError(f"--head-dim {dd}: RoPE needs an even head size")
        self.small, self.big = small, big
        self.m = dd // d
        half, big_half = d // 2, dd // 2
        pairs = torch.arange(half) * self.m
        self.qk_dims = torch.cat((pairs, pairs + big_half))  # small q/k dim -> big dim
        r_small = small.num_heads // small.num_kv_heads
        r_big = big.num_heads // big.num_kv_heads
        copies = -(-r_small // r_big)
        if small.num_kv_heads * copies > big.num_kv_heads:
            raise ValueError(
                f"--kv-heads {big.num_kv_heads}: the small model's {small.num_kv_heads} kv groups "
                f"of {r_small} q heads need {small.num_kv_heads * copies} big groups of {r_big}"
            )
        # small kv group g -> big groups [g·copies, (g+1)·copies); its t-th q head -> the
        # (t % r_big)-th q head of big group g·copies + t // r_big
        self.kv_heads = [
            list(range(g * copies, (g + 1) * copies)) for g in range(small.num_kv_heads)
        ]
        self.q_heads = [
            (g * copies + t // r_big) * r_big + t % r_big
            for g in range(small.num_kv_heads)
            for t in range(r_small)
        ]
        self.pad_dim = h
        self.const = math.sqrt(small.rms_norm_eps * h / 2)
        self.norm_scale = math.sqrt(h / hh)

    def eps(self, dtype: torch.dtype) -> float:
        """eps' for the constant as stored in `dtype` (its c² must cancel exactly)."""
        c = torch.tensor(self.const, dtype=dtype).double().item()
        return (self.small.rms_norm_eps * self.small.hidden_size - c * c) / self.big.hidden_size

    def rope_theta(self) -> float:
        return self.small.rope_theta ** (self.big.head_dim / (self.m * self.small.head_dim))

    # -- tensors (float32, on the generator's device) -------------------------------------------

    def norm(self, small: Tensor | None, *, final: bool = False) -> Tensor:
        out = torch.full((self.big.hidden_size,), self.norm_scale, device=self.device)
        if small is not None:
            out[: self.small.hidden_size] = small.float() * self.norm_scale
        out[self.pad_dim] = 1.0 if final else 0.0  # only the LM head reads dim P
        return out

    def q_proj(self, small: Tensor) -> Tensor:
        d, dd, h = self.small.head_dim, self.big.head_dim, self.small.hidden_size
        out = self.random(self.big.num_heads * dd, self.big.hidden_size)
        scale = math.sqrt(dd / d)
        for j, big_head in enumerate(self.q_heads):
            rows = out[big_head * dd : (big_head + 1) * dd]
            rows.zero_()
            rows[self.qk_dims, :h] = small[j * d : (j + 1) * d].float() * scale
        return out

    def kv_proj(self, small: Tensor, dims: Tensor) -> Tensor:
        d, dd, h = self.small.head_dim, self.big.head_dim, self.small.hidden_size
        out = self.random(self.big.num_kv_heads * dd, self.big.hidden_size)
        for g, big_heads in enumerate(self.kv_heads):
            for big_head in big_heads:
                rows = out[big_head * dd : (big_head + 1) * dd]
                rows.zero_()
                rows[dims, :h] = small[g * d : (g + 1) * d].float()
        return out

    def o_proj(self, small: Tensor | None) -> Tensor:
        d, dd, h = self.small.head_dim, self.big.head_dim, self.small.hidden_size
        out = torch.zeros(self.big.hidden_size, self.big.num_heads * dd, device=self.device)
        if small is not None:
            for j, big_head in enumerate(self.q_heads):
                out[:h, big_head * dd : big_head * dd + d] = small[:, j * d : (j + 1) * d].float()
        return out

    def mlp_in(self, small: Tensor) -> Tensor:
        out = self.random(self.big.intermediate_size, self.big.hidden_size)
        out[: small.shape[0]] = 0.0
        out[: small.shape[0], : small.shape[1]] = small.float()
        return out

    def mlp_out(self, small: Tensor | None) -> Tensor:
        out = torch.zeros(self.big.hidden_size, self.big.intermediate_size, device=self.device)
        if small is not None:
            out[: small.shape[0], : small.shape[1]] = small.float()
        return out

    def embedding(self, small: Tensor, *, lm_head: bool) -> Tensor:
        """Rows [vocab, H]: the embedding (constant c at P) and/or the LM head (padded rows read
        −PAD_WEIGHT at P). A tied model's one matrix is both."""
        v, h = small.shape
        out = torch.zeros(self.big.vocab_size, self.big.hidden_size, device=self.device)
        out[:v, :h] = small.float()
        out[:v, self.pad_dim] = 0.0 if lm_head and not self.big.tie_word_embeddings else self.const
        if lm_head:
            out[v:, self.pad_dim] = -PAD_WEIGHT
        return out

    def layer(self, small: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """A decoder layer's tensors (names after `layers.N.`); None: an extra, identity layer."""
        if small is None:
            return {
                "input_layernorm.weight": self.norm(None),
                "self_attn.q_proj.weight": self.random(*self.q_shape()),
                "self_attn.k_proj.weight": self.random(*self.kv_shape()),
                "self_attn.v_proj.weight": self.random(*self.kv_shape()),
                "self_attn.o_proj.weight": self.o_proj(None),
                "post_attention_layernorm.weight": self.norm(None),
                "mlp.gate_proj.weight": self.random(*self.mlp_shape()),
                "mlp.up_proj.weight": self.random(*self.mlp_shape()),
                "mlp.down_proj.weight": self.mlp_out(None),
            }
        v_dims = torch.arange(self.small.head_dim)
        return {
            "input_layernorm.weight": self.norm(small["input_layernorm.weight"]),
            "self_attn.q_proj.weight": self.q_proj(small["self_attn.q_proj.weight"]),
            "self_attn.k_proj.weight": self.kv_proj(small["self_attn.k_proj.weight"], self.qk_dims),
            "self_attn.v_proj.weight": self.kv_proj(small["self_attn.v_proj.weight"], v_dims),
            "self_attn.o_proj.weight": self.o_proj(small["self_attn.o_proj.weight"]),
            "post_attention_layernorm.weight": self.norm(small["post_attention_layernorm.weight"]),
            "mlp.gate_proj.weight": self.mlp_in(small["mlp.gate_proj.weight"]),
            "mlp.up_proj.weight": self.mlp_in(small["mlp.up_proj.weight"]),
            "mlp.down_proj.weight": self.mlp_out(small["mlp.down_proj.weight"]),
        }

    def fc(self, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """EAGLE's fc [h, 2h] over cat(embed, feature) -> [H, 2H]; row P copies the embedding's
        constant, so the head's residual (and its prediction) carries c at P."""
        h, hh = self.small.hidden_size, self.big.hidden_size
        w = torch.zeros(hh, 2 * hh, device=self.device)
        w[:h, :h] = weight[:, :h].float()
        w[:h, hh : hh + h] = weight[:, h:].float()
        w[self.pad_dim, self.pad_dim] = 1.0
        b = torch.zeros(hh, device=self.device)
        b[:h] = bias.float()
        return w, b

    # -- helpers ---------------------------------------------------------------------------------

    def random(self, *shape: int) -> Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device) * INIT_STD

    def q_shape(self) -> tuple[int, int]:
        return self.big.num_heads * self.big.head_dim, self.big.hidden_size

    def mlp_shape(self) -> tuple[int, int]:
        return self.big.intermediate_size, self.big.hidden_size

    def kv_shape(self) -> tuple[int, int]:
        return self.big.num_kv_heads * self.big.head_dim, self.big.hidden_size


def big_args(small: ModelArgs, shape: Shape, *, eagle: bool) -> ModelArgs:
    return replace(
        small,
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=1 if eagle else shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=small.tie_word_embeddings if shape.tied is None else shape.tied,
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
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Writes the grown checkpoint of `src` (a Llama or an EAGLE head) at `dst`."""
    eagle = is_eagle_checkpoint(src)
    small_args = read_args(src, allow_eagle=eagle)
    growth = Growth(small_args, big_args(small_args, shape, eagle=eagle), device=device, seed=seed)
    small = {k: v.to(growth.device) for k, v in read_tensors(src).items()}
    names, make = grown_tensors(growth, small, eagle=eagle)
    config = grown_config(src, growth, dtype)
    write_shards(dst, names, config, make, dtype=dtype, progress=progress)
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path, help="small checkpoint (Llama or specpair EAGLE head)")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named big shape")
    for field in ("hidden", "layers", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        parser.add_argument(f"--{field}", type=int, help="(overrides --shape)")
    parser.add_argument("--tied", choices=["yes", "no"], help="tie embeddings (default: shape's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="where tensors are built (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = SHAPES[args.shape] if args.shape else None
    values = {}
    for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        value = getattr(args, field)
        if value is None and base is None:
            parser.error(f"--{field.replace('_', '-')} is required without --shape")
        values[field] = value if value is not None else getattr(base, field)
    tied = base.tied if base else None
    if args.tied:
        tied = args.tied == "yes"
    shape = Shape(**values, tied=tied)
    t0 = time.perf_counter()
    try:
        grow(
            args.src, args.dst, shape, dtype=getattr(torch, args.dtype), device=args.device,
            seed=args.seed, progress=lambda m: print(f"  {m}", flush=True),
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    print(f"{args.src} -> {args.dst} ({shape}) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
