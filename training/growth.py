"""Where each small parameter lands in a grown model (`grow.py` has the construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specpair.models.args import ModelArgs

PAD_WEIGHT = 2.0**14  # exact in bf16
INIT_STD = 0.02  # the random inputs of extra heads, units and layers


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
    "llama3-70b": Shape(8192, 80, 64, 8, 128, 28672, 128256, tied=False),
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

    def fc(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """An EAGLE fc [h, k·h] over k concatenated h-wide inputs -> [H, k·H], input chunk i at
        [i·H, i·H + h): EAGLE-1's cat(embed, feature) (k = 2), EAGLE-3's three target layers
        (k = 3). Row P copies chunk 0's constant, so the head's residual (and its prediction)
        carries c at P."""
        h, hh = self.small.hidden_size, self.big.hidden_size
        chunks = weight.shape[1] // h
        w = torch.zeros(hh, chunks * hh, device=self.device)
        for i in range(chunks):
            w[:h, i * hh : i * hh + h] = weight[:, i * h : (i + 1) * h].float()
        w[self.pad_dim, self.pad_dim] = 1.0
        b = torch.zeros(hh, device=self.device)
        if bias is not None:
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
