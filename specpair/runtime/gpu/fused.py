"""Load-time fusion of the Llama decoder for the GPU: fewer, fuller kernels per layer.

`fuse_decoder(model)` swaps each `DecoderLayer` for a `FusedDecoderLayer` with the same call
signature `(x, cos, sin, attend) -> x`, each final `RMSNorm` for a `FusedRMSNorm` and the LM
head for a `FusedLMHead`, so `LlamaModel.forward` and `EagleHead.forward` run unchanged.

At batch 1 a forward is a chain of weight reads, and every kernel boundary idles the memory bus,
so a layer on the GPU is nine kernels (`python -m bench.gpu_rounds profile` counts them):

    add_rmsnorm(x, down partials of the previous layer) → QKV GEMV → rope_write (q; k, v into
    the paged cache) → attention → O GEMV → add_rmsnorm → gate/up GEMV → silu·mul → down GEMV

Matmuls with at most 16 rows run as Triton split-K GEMVs that leave fp32 partials [S, N, out]
(`triton_kernels.gemv_partials`); the next kernel sums them on load, so no split-K reduce runs
and the residual add of the down projection moves into the next layer's norm: a layer inside a
`LlamaBody` returns `Pending(x, delta)` and the next layer (or the final norm) adds it. Larger
matmuls go to cuBLAS and their [N, out] output is the one-partial case. On CPU (tests) the same
structure runs in plain torch, one partial each.

A tensor-parallel shard (`models/parallel.py`) fuses the same way over its own heads and
columns; its O and down projections give partial sums of the whole output, so each is summed
over its split-K partials and then over the ranks (one all-reduce, [1, N, H]) before the norm
that reads it, and its vocabulary-parallel head all-gathers the logits: two all-reduces a layer
and one all-gather a forward, inside the CUDA graphs like every other kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpair.models.eagle3 import Eagle3Layer
from specpair.models.llama import Attend, DecoderLayer, LlamaBody, RMSNorm
from specpair.models.loading import CheckpointError
from specpair.models.parallel import RowParallelLinear, VocabParallelHead, gather_vocab, reduce_sum

_kernels: Any = None
GEMV_MAX_ROWS = 16
# The batch-invariant mode's tiles above GEMV_MAX_ROWS rows: (rows, weight rows, stages). A row's
# sum runs the weight's split-K and K tiles in one order whatever the tile's rows and width, so
# the mode may size tiles by M: the GEMV's 16 rows up to 16 (the default mode's kernel), then 64
# × 128, which stream the weight once for 64 rows (batch 8 at tier 7) and halve the passes over
# a prefill's rows. Same bits for every tile on an H100 (tests/gpu/test_kernels.py); 64 × 128
# runs a 1100-row prefill's matmuls in 0.68–0.89× the time of 64 × 64 (bench/CHOICES.md).
INVARIANT_TILE = (64, 128, 3)


def _triton() -> Any:
    """The Triton kernels, compiled on first use (imported lazily: CPU never needs Triton)."""
    global _kernels
    if _kernels is None:
        from specpair.runtime.gpu import triton_kernels

        _kernels = triton_kernels
    return _kernels


@dataclass(slots=True)
class Pending:
    """A residual stream whose last delta is not added yet: x [B, T, H] + sum(delta [S, N, H])."""

    x: Tensor
    delta: Tensor

    def materialize(self) -> Tensor:
        """x + the delta (an EAGLE-3 feature: the output of a layer inside a `LlamaBody`), as
        the CPU's `add_rmsnorm` sums it; the GPU kernel may round the last bit otherwise, which
        only steers the draft, never what the target accepts."""
        return self.x + self.delta.sum(0).view(self.x.shape).to(self.x.dtype)


def linear_parts(
    x: Tensor, weight: Tensor, invariant: bool = False, splits: int | None = None
) -> Tensor:
    # x: [N, K], weight: [out, K] -> partials [S, N, out] whose sum is x @ weight.T.
    # `invariant`: every N through the Triton kernel, whose split-K and K order depend on the
    # weight alone, so a row's result is the same in any batch (cuBLAS picks its kernel by N);
    # `splits` overrides the weight's split-K.
    small = x.shape[0] <= GEMV_MAX_ROWS
    if x.is_cuda and (invariant or small):
        cfg = _triton().gemv_config(weight.shape[0], weight.shape[1])
        if cfg is not None:
            if splits is not None:
                cfg = (splits, *cfg[1:])
            if small:
                return _triton().gemv_partials(x, weight, *cfg, bm=GEMV_MAX_ROWS)
            bm, bn, stages = INVARIANT_TILE
            return _triton().gemv_partials(x, weight, cfg[0], bn, cfg[2], cfg[3], stages, bm=bm)
        if invariant:
            raise ValueError(
                f"the batch-invariant mode needs K a multiple of 128: weight {tuple(weight.shape)}"
            )
    return F.linear(x, weight)[None]


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # x: [N, H] -> [N, H]; fp32 statistics like RMSNorm
    if x.is_cuda:
        return _triton().rmsnorm(x, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm(x: Tensor, parts: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # x: [N, H], parts: [S, N, H] -> (x + sum(parts), rmsnorm of it), one pass on the GPU
    if x.is_cuda:
        return _triton().add_rmsnorm(x, parts, weight, eps)
    s = x + parts.sum(0).to(x.dtype)
    return s, rmsnorm(s, weight, eps)


def rope_qk(
    qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    # qkv: [N, (Hq + 2 Hkv) D], cos/sin: [N, D] -> q [N, Hq, D], k [N, Hkv, D] (contiguous)
    n = qkv.shape[0]
    qk = qkv[:, : (n_q + n_kv) * head_dim].reshape(n, n_q + n_kv, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    out = qk * cos[:, None] + rotated * sin[:, None]
    return out[:, :n_q].contiguous(), out[:, n_q:].contiguous()


def silu_mul(parts: Tensor, dtype: torch.dtype) -> Tensor:
    # parts: [S, N, 2I] -> silu(gate) * up: [N, I] in dtype
    if parts.is_cuda:
        return _triton().silu_mul(parts, dtype)
    gate, up = parts.sum(0).to(dtype).chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: Tensor | Pending) -> Tensor:
        if isinstance(x, Pending):
            h = x.x.shape[-1]
            normed = add_rmsnorm(x.x.reshape(-1, h), x.delta, self.weight, self.eps)[1]
            return normed.view(x.x.shape)
        return rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class FusedLMHead(nn.Module):
    """The LM head as a GEMV at few rows: its one fp32 partial is the logits (no cast kernel)."""

    def __init__(self, head: nn.Linear, invariant: bool = False) -> None:
        super().__init__()
        self.weight = head.weight
        self.invariant = invariant

    def forward(self, hidden: Tensor) -> Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        # invariant: one partial, so no torch reduce (whose order may follow the row count)
        parts = linear_parts(x, self.weight, self.invariant, 1 if self.invariant else None)
        logits = parts[0] if parts.shape[0] == 1 else parts.sum(0)
        return logits.view(*hidden.shape[:-1], -1)


class FusedVocabParallelHead(FusedLMHead):
    """A rank's vocabulary rows of the LM head as a GEMV, the logits shards all-gathered."""

    def __init__(self, head: VocabParallelHead) -> None:
        super().__init__(head)
        self.vocab_size, self.world = head.vocab_size, head.world

    def forward(self, hidden: Tensor) -> Tensor:
        local = super().forward(hidden)  # this rank's rows: [..., V / world]
        whole = gather_vocab(local.reshape(-1, local.shape[-1]), self.world, self.vocab_size)
        return whole.view(*hidden.shape[:-1], -1)


def reduced(parts: Tensor) -> Tensor:
    """A row-parallel projection's partials [S, N, out] on one rank -> the whole output as one
    float32 partial [1, N, out], summed over the ranks. Summed in float32 as one rank sums its
    split-K partials: a cuBLAS output (more than GEMV_MAX_ROWS rows) is bf16, and adding the
    ranks' bf16 sums would round each layer's output once more than one GPU does."""
    if parts.shape[0] > 1 or parts.dtype != torch.float32:
        parts = parts.sum(0, keepdim=True, dtype=torch.float32)
    return reduce_sum(parts)


class FusedDecoderLayer(nn.Module):
    """A `DecoderLayer` with concatenated projections; same math, fewer launches."""

    def __init__(self, layer: DecoderLayer | Eagle3Layer, invariant: bool = False) -> None:
        super().__init__()
        self.invariant = invariant  # see `linear_parts`
        attn, mlp = layer.self_attn, layer.mlp
        # The kernels below implement bias-free SwiGLU only; anything else would decode wrong.
        biases = [name for name, _ in layer.named_parameters() if name.endswith(".bias")]
        if biases or mlp.act is not F.silu:
            raise CheckpointError(
                "the fused GPU decoder implements bias-free SwiGLU layers only; this model has "
                f"biases {biases} and activation {getattr(mlp.act, '__name__', mlp.act)!r} "
                "(serve it with --device cpu)"
            )
        self.layer_index = attn.layer_index
        self.n_q, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        self.eps = layer.post_attention_layernorm.eps
        norm = layer.input_layernorm
        self.input_norm = norm.weight if isinstance(norm, RMSNorm) else None  # None: EAGLE-1/2
        self.post_norm = layer.post_attention_layernorm.weight
        with torch.no_grad():
            qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            self.qkv = nn.Parameter(torch.cat(qkv), requires_grad=False)  # [(Hq + 2Hkv) D, H]
            gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
            self.gate_up = nn.Parameter(torch.cat(gate_up), requires_grad=False)  # [2I, H]
        self.o = attn.o_proj.weight
        self.down = mlp.down_proj.weight
        # a tensor-parallel shard's (both or neither are row-parallel: `_shard_layer`)
        self.sharded = isinstance(attn.o_proj, RowParallelLinear)
        if self.sharded and invariant:
            raise ValueError("the batch-invariant mode does not run tensor-parallel")
        self.defer_residual = False  # set inside a LlamaBody, whose next layer or norm adds it

    def forward(
        self, x: Tensor | Pending, cos: Tensor, sin: Tensor, attend: Attend
    ) -> Tensor | Pending:
        # x: [B, T, H] (or pending), cos/sin: [B, T, 1, D] -> [B, T, H] (or pending)
        shape = x.x.shape if isinstance(x, Pending) else x.shape
        b, t, h = shape
        n = b * t
        if isinstance(x, Pending):  # inside a LlamaBody, whose layers all have an input norm
            assert self.input_norm is not None
            resid, normed = add_rmsnorm(x.x.reshape(n, h), x.delta, self.input_norm, self.eps)
        else:
            resid = x.reshape(n, h)
            normed = resid if self.input_norm is None else rmsnorm(resid, self.input_norm, self.eps)
        return self._block(resid, normed, cos, sin, attend, shape)

    def _block(
        self,
        resid: Tensor,
        normed: Tensor,
        cos: Tensor,
        sin: Tensor,
        attend: Attend,
        shape: torch.Size,
    ) -> Tensor | Pending:
        # resid [N, H], normed [N, K] (the QKV's input) -> the layer's output [B, T, H]
        b, t, _ = shape
        n, d = b * t, self.head_dim
        inv = self.invariant
        qkv = linear_parts(normed, self.qkv, inv)
        out = self._attention(qkv, cos.reshape(n, d), sin.reshape(n, d), attend, b, t)
        o = linear_parts(out.reshape(n, -1), self.o, inv)
        if self.sharded:
            o = reduced(o)
        resid, normed = add_rmsnorm(resid, o, self.post_norm, self.eps)
        gate_up = linear_parts(normed, self.gate_up, inv)
        down = linear_parts(silu_mul(gate_up, resid.dtype), self.down, inv)
        if self.sharded:
            down = reduced(down)
        if self.defer_residual:
            return Pending(resid.view(shape), down)
        return add_rmsnorm(resid, down, self.post_norm, self.eps)[0].view(shape)

    def _attention(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, attend: Attend, b: int, t: int
    ) -> Tensor:
        # qkv: partials [S, N, (Hq + 2 Hkv) D] -> attention output [B, T, Hq, D]
        n_q, n_kv, d = self.n_q, self.n_kv, self.head_dim
        if attend.fused_write:  # the Triton rope_write: a GPU cache, a fused backend
            q = attend.rope_write(self.layer_index, qkv, cos, sin)
            return attend.run(self.layer_index, q.view(b, t, n_q, d))
        full = (qkv.sum(0) if qkv.shape[0] > 1 else qkv[0]).to(cos.dtype)
        q, k = rope_qk(full, cos, sin, n_q, n_kv, d)
        v = full[:, (n_q + n_kv) * d :].view(b, t, n_kv, d)
        return attend(self.layer_index, q.view(b, t, n_q, d), k.view(b, t, n_kv, d), v)


class FusedEagle3Layer(FusedDecoderLayer):
    """An EAGLE-3 midlayer (`Eagle3Layer`): the QKV GEMV reads [input_norm(embeds) ‖
    hidden_norm(hidden)] (2H wide), the residual stream is `hidden`; the rest is the decoder's."""

    def __init__(self, layer: Eagle3Layer, invariant: bool = False) -> None:
        super().__init__(layer, invariant)
        self.hidden_norm = layer.hidden_norm.weight

    def forward(  # type: ignore[override]
        self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend
    ) -> Tensor:
        # embeds, hidden: [B, T, H], cos/sin: [B, T, 1, D] -> [B, T, H]
        assert self.input_norm is not None
        shape = hidden.shape
        h = shape[-1]
        resid = hidden.reshape(-1, h)
        normed = torch.cat(
            (
                rmsnorm(embeds.reshape(-1, h), self.input_norm, self.eps),
                rmsnorm(resid, self.hidden_norm, self.eps),
            ),
            dim=-1,
        )
        out = self._block(resid, normed, cos, sin, attend, shape)
        assert isinstance(out, Tensor)  # a midlayer adds its residual itself
        return out


def fuse_decoder(module: nn.Module, invariant: bool = False) -> nn.Module:
    """Replaces every DecoderLayer / RMSNorm / `lm_head` inside `module` in place (frees the
    split weights); layers of a `LlamaBody` defer their last residual add to what follows.
    `invariant`: the batch-invariant mode's matmuls (`linear_parts`)."""
    for name, child in list(module.named_children()):
        if isinstance(child, Eagle3Layer):
            setattr(module, name, FusedEagle3Layer(child, invariant))
        elif isinstance(child, DecoderLayer):
            setattr(module, name, FusedDecoderLayer(child, invariant))
        elif isinstance(child, RMSNorm):
            setattr(module, name, FusedRMSNorm(child))
        elif isinstance(child, VocabParallelHead):
            setattr(module, name, FusedVocabParallelHead(child))
        elif name == "lm_head" and type(child) is nn.Linear and child.bias is None:
            setattr(module, name, FusedLMHead(child, invariant))
        else:
            fuse_decoder(child, invariant)
    if isinstance(module, LlamaBody):
        for layer in module.layers:
            if isinstance(layer, FusedDecoderLayer):
                layer.defer_residual = True
    return module
