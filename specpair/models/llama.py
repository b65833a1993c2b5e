"""A Llama-family decoder in plain torch: RMSNorm, RoPE (`rope.py`: Llama-3, linear or YaRN
scaling), GQA, a gated MLP (SwiGLU by default), optional projection biases (Qwen2: q/k/v only);
its shape is a `ModelArgs` (`args.py`).

The model knows nothing about caches or batching: every forward takes an `Attend`, bound by the
runtime to one batch's KV layout, that stores the new keys/values of a layer and returns the
attention output.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from specpair.models.args import ACTIVATIONS, ModelArgs
from specpair.models.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_scale


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
