"""A sampled draft step's draw as one Triton kernel after the topk (GPU only).

`sampling.draft_support` is some 40 small kernels a step (warp, cut, renormalise, inverse
CDF): in a graph each costs a launch whatever its size, 122 µs a step at batch 1 over a
32 000-id draft vocabulary on an H200, 7 of them in a tier-7 round. `draft_support` here keeps
torch's topk and does the rest in one program per row: the row's normaliser over every logit,
its K likeliest tokens' probabilities, the top-k / top-p / min-p cut, q renormalised and the
draw from it by the inverse CDF, as the torch version computes them (the float sums may round
apart; q is always exactly the distribution the token was drawn from, which is all the
target's rejection sampling needs of it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpair.runtime.sampling import RowParams, draft_candidates

ROW_BLOCK = 2048  # logits read a loop step while the normaliser is summed


@triton.jit
def _draw(
    x_ptr,  # logits [R, N] float32 (rows contiguous)
    n,
    top_ptr,  # their k largest [R, k], descending
    k,
    params_ptr,  # RowParams.table [R, 5]
    u_ptr,  # [R] uniforms
    q_ptr,  # out: q [R, k]
    pick_ptr,  # out: the drawn column [R] (0, the likeliest, for a greedy row)
    KP: tl.constexpr,  # k rounded up to a power of two
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(params_ptr + row * 5)
    top_k = tl.load(params_ptr + row * 5 + 1)
    top_p = tl.load(params_ptr + row * 5 + 2)
    min_p = tl.load(params_ptr + row * 5 + 3)
    greedy = tl.load(params_ptr + row * 5 + 4)
    cols = tl.arange(0, KP)
    real = cols < k
    top = tl.load(top_ptr + row * k + cols, mask=real, other=float("-inf"))
    m = tl.max(top, 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)  # sum over the row of exp((x - max) / t)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + offs, mask=offs < n, other=float("-inf"))
        acc += tl.exp((x - m) / t)
    p = tl.exp((top - m) / t) / tl.sum(acc, 0)  # 0 past k
    width = tl.where((top_k > 0) & (top_k < k), top_k, k * 1.0)
    keep = real & (cols.to(tl.float32) < width)
    keep = keep & ((tl.cumsum(p, 0) - p) < top_p)  # top-p over the whole vocabulary's mass
    keep = keep & (p >= min_p * tl.max(p, 0))  # min-p of the likeliest
    q = tl.where(keep, p, 0.0)
    q = q / tl.sum(q, 0)
    tl.store(q_ptr + row * k + cols, q, mask=real)
    # inverse CDF (`sampling._inverse_cdf`): the first column whose cumulative mass passes
    # u × the total, never one without mass
    u = tl.load(u_ptr + row)
    cdf = tl.cumsum(q, 0)
    pick = tl.sum((cdf <= u * tl.sum(q, 0)).to(tl.int32), 0)
    last = tl.max(tl.where(q > 0, cols, 0), 0)
    pick = tl.minimum(pick, last)
    pick = tl.where(greedy > 0, 0, pick)
    tl.store(pick_ptr + row, pick.to(tl.int64))


def draft_support(
    logits: Tensor,
    params: RowParams,
    u: Tensor,
    width: int | None = None,
    names: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`sampling.draft_support` on a CUDA device, its arguments and results the same: (tokens
    [R], ids [R, K], q [R, K]). Graph-safe."""
    x = logits.float().contiguous()
    top, ids = draft_candidates(x, width, names)  # a positive temperature keeps the order
    (r, n), k = x.shape, top.shape[-1]
    q = torch.empty(r, k, dtype=torch.float32, device=x.device)
    pick = torch.empty(r, dtype=torch.long, device=x.device)
    table, u = params.table.float().contiguous(), u.float().contiguous()
    kp = triton.next_power_of_2(k)
    _draw[(r,)](x, n, top.contiguous(), k, table, u, q, pick, KP=kp, BLOCK=ROW_BLOCK)
    return ids.gather(-1, pick[:, None])[:, 0], ids, q
