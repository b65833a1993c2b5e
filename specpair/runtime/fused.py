"""Load-time fusion of the Llama decoder for the GPU: one QKV and one gate/up matmul per layer.

`fuse_decoder(model)` swaps each `DecoderLayer` for a `FusedDecoderLayer` with the same call
signature `(x, cos, sin, attend) -> x`, so `LlamaModel.forward` and `EagleHead.forward` run
unchanged. Per layer the GPU then launches about a dozen kernels: rmsnorm, QKV, rope, attention
(write + attend), O, add+rmsnorm, gate/up, silu·mul, down, add. At batch 1 a forward is a chain
of weight reads; every extra elementwise kernel is a few µs of idle memory bus, hence Triton
for the four elementwise stages. On CPU (tests) the same stages run as plain torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpair.models.llama import AttendFn, DecoderLayer, RMSNorm

_kernels: Any = None


def _triton() -> Any:
    """The Triton kernels, compiled on first use (imported lazily: CPU never needs Triton)."""
    global _kernels
    if _kernels is None:
        from specpair.runtime import triton_kernels

        _kernels = triton_kernels
    return _kernels


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # x: [N, H] -> [N, H]; fp32 statistics like RMSNorm
    if x.is_cuda:
        return _triton().rmsnorm(x, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # x, delta: [N, H] -> (x + delta, rmsnorm(x + delta)), one pass over the row on the GPU
    if x.is_cuda:
        return _triton().add_rmsnorm(x, delta, weight, eps)
    s = x + delta
    return s, rmsnorm(s, weight, eps)


def rope_qk(
    qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    # qkv: [N, (Hq + 2 Hkv) D], cos/sin: [N, D] -> q [N, Hq, D], k [N, Hkv, D] (contiguous)
    if qkv.is_cuda:
        return _triton().rope_qk(qkv, cos, sin, n_q, n_kv, head_dim)
    n = qkv.shape[0]
    qk = qkv[:, : (n_q + n_kv) * head_dim].reshape(n, n_q + n_kv, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    out = qk * cos[:, None] + rotated * sin[:, None]
    return out[:, :n_q].contiguous(), out[:, n_q:].contiguous()


def silu_mul(gate_up: Tensor) -> Tensor:
    # gate_up: [N, 2I] -> silu(gate) * up: [N, I]
    if gate_up.is_cuda:
        return _triton().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: Tensor) -> Tensor:
        return rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class FusedDecoderLayer(nn.Module):
    """A `DecoderLayer` with concatenated projections; same math, fewer launches."""

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_index = attn.layer_index
        self.n_q, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        self.eps = layer.input_layernorm.eps
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        with torch.no_grad():
            qkv = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
            self.qkv = nn.Parameter(torch.cat(qkv), requires_grad=False)  # [(Hq + 2Hkv) D, H]
            gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
            self.gate_up = nn.Parameter(torch.cat(gate_up), requires_grad=False)  # [2I, H]
        self.o = attn.o_proj.weight
        self.down = mlp.down_proj.weight

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: AttendFn) -> Tensor:
        # x: [B, T, H], cos/sin: [B, T, 1, D] -> [B, T, H]
        b, t, h = x.shape
        n, d = b * t, self.head_dim
        x2 = x.reshape(n, h)
        qkv = F.linear(rmsnorm(x2, self.input_norm, self.eps), self.qkv)
        q, k = rope_qk(qkv, cos.reshape(n, d), sin.reshape(n, d), self.n_q, self.n_kv, d)
        v = qkv[:, (self.n_q + self.n_kv) * d :].view(b, t, self.n_kv, d)
        out = attend(self.layer_index, q.view(b, t, self.n_q, d), k.view(b, t, self.n_kv, d), v)
        x2, normed = add_rmsnorm(x2, F.linear(out.reshape(n, -1), self.o), self.post_norm, self.eps)
        x2 = x2 + F.linear(silu_mul(F.linear(normed, self.gate_up)), self.down)
        return x2.view(b, t, h)


def fuse_decoder(module: nn.Module) -> nn.Module:
    """Replaces every DecoderLayer / RMSNorm inside `module` in place (frees the split weights)."""
    for name, child in list(module.named_children()):
        if isinstance(child, DecoderLayer):
            setattr(module, name, FusedDecoderLayer(child))
        elif isinstance(child, RMSNorm):
            setattr(module, name, FusedRMSNorm(child))
        else:
            fuse_decoder(child)
    return module
