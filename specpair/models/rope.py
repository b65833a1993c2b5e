"""Rotary position embeddings: the inverse frequencies of a config's scaling (none, linear,
Llama-3, YaRN), the cos/sin of a batch's positions, and the rotation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specpair.models.args import ModelArgs

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim / 2], with the configured scaling (`ROPE_TYPES`)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(args.rope_scaling)
    kind = rope_type(args)
    if kind is None:
        return inv_freq
    if kind == "linear":  # position interpolation: every angle divided by `factor`
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn(args)[0]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_scale(args: ModelArgs) -> float:
    """The factor on cos and sin: YaRN's attention factor (scales q·k by its square), else 1."""
    return _yarn(args)[1] if rope_type(args) == "yarn" else 1.0


def rope_type(args: ModelArgs) -> str | None:
    """None (plain RoPE) or the scaling: v5 configs say `rope_type`, Llama-2 era ones `type`."""
    scaling = dict(args.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    return None if kind is None else str(kind)


def _yarn(args: ModelArgs) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071) as `transformers` computes it: dimensions that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), more
    than `beta_fast` times kept, a linear ramp between; cos/sin are scaled by an attention
    factor, 0.1 ln(factor) + 1 unless given."""
    s, dim, base = dict(args.rope_scaling), args.head_dim, args.rope_theta
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or args.max_position_embeddings / old_len

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        both = s.get("mscale") and s.get("mscale_all_dim")
        attention = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if both else mscale()

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return ramp / (factor * pos_freqs) + (1 - ramp) / pos_freqs, float(attention)


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    # positions: [B, T] -> cos, sin: [B, T, 1, D] (broadcast over heads); scale: `rope_scale`
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
