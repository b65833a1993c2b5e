"""A Llama-family decoder in plain torch: RMSNorm, RoPE (Llama-3, linear or YaRN scaling), GQA,
a gated MLP (SwiGLU by default), optional projection biases (Qwen2: q/k/v only).

The model knows nothing about caches or batching: every forward takes an `Attend`, bound by the
runtime to one batch's KV layout, that stores the new keys/values of a layer and returns the
attention output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attend(Protocol):
    """One forward's attention over the KV cache (`runtime.attention.PagedAttend`)."""

    # True where `rope_write` + `run` serve (the fused GPU layer's split form)
    fused_write: bool

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, T, Hq, D], k, v [B, T, Hkv, D]: stores k, v, returns [B, T, Hq, D]."""

    def rope_write(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """qkv partials [S, N, (Hq + 2 Hkv) D], cos/sin [N, D]: rotates q and k, stores k and
        v, returns q [N, Hq, D]."""

    def run(self, layer: int, q: Tensor) -> Tensor:
        """q [B, T, Hq, D] -> [B, T, Hq, D] over the K/V already stored."""


class Deferred(Protocol):
    """A layer output whose last residual add is left to the next kernel (`gpu/fused.py`)."""

    def materialize(self) -> Tensor:
        """The output as a tensor [B, T, H]."""


def materialized(x: Tensor | Deferred) -> Tensor:
    return x if isinstance(x, Tensor) else x.materialize()


# `hidden_act` values of a config, each computed as transformers' ACT2FN computes it.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # erf form
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # frozen copy of HF's rope_parameters
    hidden_act: str = "silu"
    qkv_bias: bool = False  # Llama's attention_bias sets both; Qwen2 has q/k/v bias only
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: attention sees only the last N positions

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not implemented "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelArgs:
        """Reads a `transformers` Llama, Mistral or Qwen2 config (v4 `rope_scaling` or v5
        `rope_parameters`). Checking that specpair computes what the config asks is
        `loading.read_args`'s job, which names the offending key."""
        rope = dict(
            getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        )
        theta = float(rope.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            rope_scaling=tuple(sorted(rope.items())),
            hidden_act=getattr(cfg, "hidden_act", "silu"),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2",
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            sliding_window=sliding_window(cfg),
        )


def sliding_window(cfg: Any) -> int | None:
    """The window of a config whose layers slide (Mistral, Qwen2 with use_sliding_window)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if window is None or (layer_types and "sliding_attention" not in layer_types):
        return None
    return int(window)


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        hidden, qkv_bias = args.hidden_size, args.qkv_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=args.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, *, input_norm: bool = True) -> None:
        super().__init__()
        # EAGLE-1/2 heads as published skip the input norm of their layer 0 (`eagle.py`).
        self.input_layernorm: nn.Module = (
            RMSNorm(args.hidden_size, args.rms_norm_eps) if input_norm else nn.Identity()
        )
        self.self_attn = Attention(args, layer_index)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embedding, decoder layers and final norm; parameter names follow HF's `model.*`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaModel(nn.Module):
    """Causal LM. `forward` returns final-normed hidden states; `logits` applies the LM head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.rope_scale = rope_scale(args)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        # tokens, positions: [B, T] -> hidden: [B, T, H]
        x = self.model.embed_tokens(tokens)
        return self.run_layers(x, positions, attend)

    def forward_aux(
        self, tokens: Tensor, positions: Tensor, attend: Attend, layers: tuple[int, ...]
    ) -> tuple[Tensor, Tensor]:
        """`forward` and the features an EAGLE draft reads: the outputs of `layers`
        (pre-norm residual stream) concatenated in that order, [B, T, len(layers) * H], an
        EAGLE-3 head's input; without layers the final hidden state itself."""
        aux: dict[int, Tensor] | None = {} if layers else None
        hidden = self.run_layers(self.model.embed_tokens(tokens), positions, attend, aux)
        if aux is None:
            return hidden, hidden
        return hidden, torch.cat([materialized(aux[i]) for i in layers], dim=-1)

    def run_layers(
        self, x: Tensor, positions: Tensor, attend: Attend, aux: dict[int, Tensor] | None = None
    ) -> Tensor:
        """The decoder layers and final norm; each layer's output lands in `aux` if given
        (a fused GPU layer's with its last residual add still pending: see `materialized`)."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_scale)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attend)
            if aux is not None:
                aux[i] = x
        return self.model.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
