"""A Llama-family model's shape as specpair computes it: `ModelArgs`, read from a `transformers`
config, and the activations a config may name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor

# `hidden_act` values of a config, each computed as transformers' ACT2FN computes it.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # erf form
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


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
