"""Triton kernels for the elementwise stages of a fused decoder layer (GPU only).

Each is one program per row (or per row × head), fp32 arithmetic, bf16 in and out. They exist to
cut kernel count, not flops: see `fused.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm_kernel(
    x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, h, eps, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < h
    x = tl.load(x_ptr + row * h + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(d_ptr + row * h + cols, mask=m, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * h + cols, x, mask=m)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / h + eps)
    # Like RMSNorm: normalize in fp32, round to the activation dtype, then scale by the weight.
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * h + cols, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    n, h = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rmsnorm_kernel[(n,)](x, x, weight, x, out, h, eps, ADD=False, BLOCK=triton.next_power_of_2(h))
    return out


def add_rmsnorm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    n, h = x.shape
    x, delta = x.contiguous(), delta.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _rmsnorm_kernel[(n,)](x, delta, weight, total, out, h, eps, ADD=True, BLOCK=block)
    return total, out


@triton.jit
def _rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, row_stride, n_q, n_kv, HALF: tl.constexpr
):
    # grid (N, Hq + Hkv): rotate one head of one token; q heads first, then k heads.
    row, head = tl.program_id(0), tl.program_id(1)
    d = 2 * HALF
    cols = tl.arange(0, HALF)
    src = qkv_ptr + row * row_stride + head * d
    x1 = tl.load(src + cols).to(tl.float32)
    x2 = tl.load(src + HALF + cols).to(tl.float32)
    c = tl.load(cos_ptr + row * d + cols).to(tl.float32)
    s = tl.load(sin_ptr + row * d + cols).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if head < n_q:  # noqa: SIM108 (a branch on a program id, not a Python value)
        dst = q_ptr + (row * n_q + head) * d
    else:
        dst = k_ptr + (row * n_kv + head - n_q) * d
    tl.store(dst + cols, o1.to(q_ptr.dtype.element_ty))
    tl.store(dst + HALF + cols, o2.to(q_ptr.dtype.element_ty))


def rope_qk(
    qkv: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_kv: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    n = qkv.shape[0]
    q = torch.empty(n, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, n_kv, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_kernel[(n, n_q + n_kv)](qkv, cos, sin, q, k, qkv.stride(0), n_q, n_kv, HALF=head_dim // 2)
    return q, k


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
    # F.silu rounds to bf16 before the product; do the same so eager and fused agree closely.
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: Tensor) -> Tensor:
    n, two_i = gate_up.shape
    inter = two_i // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
