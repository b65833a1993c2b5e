"""Verification as pure functions: which draft nodes the target accepts, and the bonus token.

Both work on the full tree (root = the request's last token at index 0, draft node i at
i + 1) and on per-node target scores, row j being the target's prediction *after* node j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpair.runtime.sampling import sample, sample_rows
from specpair.runtime.tree import CandidateTree, children, full_parents


@dataclass(frozen=True, slots=True)
class Acceptance:
    nodes: tuple[int, ...]  # accepted draft nodes along the path (draft indices, root excluded)
    tokens: tuple[int, ...]  # their tokens
    bonus: int  # the target's own token after the accepted path

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens, excluding the bonus (as SGLang's policy counts them)."""
        return len(self.tokens)

    @property
    def keep(self) -> list[int]:
        """Full-tree indices whose KV is committed: the root and the accepted nodes."""
        return [0] + [n + 1 for n in self.nodes]


def accept_greedy(tree: CandidateTree, target_logits: Tensor) -> Acceptance:
    """Longest path whose tokens equal the target argmax; bonus = argmax after it.

    target_logits: [n + 1, V] over the full tree.
    """
    return accept_greedy_argmax(tree, target_logits.argmax(-1).tolist())


def accept_greedy_argmax(tree: CandidateTree, argmax: Sequence[int]) -> Acceptance:
    """`accept_greedy` given the target's argmax per full-tree node ([n + 1] token ids; more
    are ignored)."""
    n = len(tree)
    if tree.is_chain():  # its leading matches, no child lists
        m = next((j for j in range(n) if tree.tokens[j] != argmax[j]), n)
        return Acceptance(tuple(range(m)), tree.tokens[:m], argmax[m])
    return greedy_path(tree, argmax)


def greedy_path(tree: CandidateTree, argmax: Sequence[int]) -> Acceptance:
    """`accept_greedy_argmax` of any tree, walking its children."""
    kids = children(full_parents(tree))
    node, path = 0, list[int]()
    while True:
        # At most one child can match the argmax (duplicate siblings: the first wins).
        nxt = next((c for c in kids[node] if tree.tokens[c - 1] == argmax[node]), None)
        if nxt is None:
            break
        path.append(nxt - 1)
        node = nxt
    return Acceptance(tuple(path), tuple(tree.tokens[i] for i in path), argmax[node])


def accept_sampling(
    tree: CandidateTree, target_probs: Tensor, generator: torch.Generator | None
) -> Acceptance:
    """Exact speculative sampling (SpecInfer-style recursive rejection over siblings).

    target_probs: [n + 1, V] warped target distributions over the full tree; the tree must
    carry draft_probs [n, V], node i's token having been drawn from draft_probs[i]. At a node
    with children x1, x2, …, child x with its q:
      accept x with probability min(1, p(x) / q(x)) — q ≤ p: always accept;
      on rejection p ← normalize((p − q)+) and try the next sibling;
      when no child is accepted the bonus is sampled from the current p.
    For a chain this is the standard rejection sampler of Leviathan et al. / Chen et al. Each
    child is tried against its own q: exact for siblings drawn i.i.d. (each carries the
    parent's q) and for siblings drawn without replacement when each carries q less the
    siblings before it (Jeon et al.'s recursive rejection); given the parent's q instead, those
    emit a biased token. The tree shapes' trees carry no q and take `accept_trees`.
    """
    if len(tree) and tree.draft_probs is None:
        raise ValueError("sampling verification needs the tree's draft_probs")
    dense = tree.dense_q(target_probs.shape[-1])
    kids = children(full_parents(tree))
    node, path = 0, list[int]()
    while True:
        p = target_probs[node]
        accepted = None
        for child in kids[node]:
            q = dense[child - 1]  # type: ignore[index]
            token = tree.tokens[child - 1]
            ratio = float(p[token]) / max(float(q[token]), 1e-30)
            u = float(torch.rand((), generator=generator))
            if u < ratio:
                accepted = child
                break
            p = residual(p[None], q[None])[0]
        if accepted is None:
            return Acceptance(
                tuple(path), tuple(tree.tokens[i] for i in path), sample(p, generator)
            )
        path.append(accepted - 1)
        node = accepted


def residual(p: Tensor, q: Tensor) -> Tensor:
    """Rows [R, V] of norm((p − q)+), where a draft drawn from q was rejected; p itself
    where p == q (no mass left: rejection there has probability 0)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def accept_chains(
    p: Tensor, q: Tensor, drafts: Tensor, lengths: Tensor, u: Tensor
) -> tuple[Tensor, Tensor]:
    """`accept_sampling` for a batch of chains as batched tensor ops on their device:
    (accepted drafts [B], last token [B]), the host reads both once.

    p: [B, n + 1, V] warped target distributions, row j after chain node j (the root: 0);
    q: [B, n, V] the distribution draft j was drawn from; drafts: [B, n] tokens; lengths: [B]
    drafts per chain (columns past one are padding); u: [B, n + 1] uniforms in [0, 1): u[b, j]
    decides draft j, u[b, lengths[b]] (used by no draft) draws the last token.
    Draft j is accepted when u < p(x) / q(x); with 3 drafts and verdicts [yes, no, yes] one is
    accepted and the last token is drawn from norm((p[1] − q[1])+); with all 3 accepted, from
    p[3] (the bonus). A greedy row is one-hot p and q: draft j is accepted iff it is the argmax,
    and the last token is the argmax.
    """
    b, n = drafts.shape
    rows = torch.arange(b, device=p.device)
    px = p[:, :n].gather(-1, drafts[..., None])[..., 0]
    qx = q.gather(-1, drafts[..., None])[..., 0]
    ok = (u[:, :n] * qx < px) & (torch.arange(n, device=p.device) < lengths[:, None])
    accepted = ok.to(torch.int32).cumprod(-1).sum(-1).long()
    last = p[rows, accepted]  # [B, V]
    if n:
        rejected = (accepted < lengths)[:, None]
        last = torch.where(rejected, residual(last, q[rows, accepted.clamp(max=n - 1)]), last)
    return accepted, sample_rows(last, u[rows, lengths])


def accept_trees(p: Tensor, tokens: Tensor, parents: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's target-only tree rule (`tree_speculative_sampling_target_only`, at its exact
    thresholds of 1) for a batch of trees as batched tensor ops: (accepted [B, T] bool over
    the full tree, the root never; last token [B]).

    p: [B, T, V] warped target distributions over each full tree (row j after node j);
    tokens: [B, T] (column 0, the root, unused); parents: [B, T] full-tree parents (-1: the
    root, or padding past a tree's end); u: [B, T] uniforms: u[b, j] decides node j (j ≥ 1),
    u[b, 0] draws the last token.

    The candidates are a function of the draft alone, so q is the one-hot of each node:
    SpecInfer's recursive rejection with per-node q reduces to, at the current node, trying its
    children in order: accept child x with probability p(x); on a rejection p ← p with x
    removed, renormalised; no child accepted → the last token is drawn from what p is left;
    after a leaf, from the leaf's row (the bonus). Its output is distributed as p exactly
    (sampling p by elimination), whatever candidates the draft chose.

    Without a loop over the nodes: a child is tried only once its parent was accepted and
    its earlier siblings rejected, and p is then its parent's row less those siblings'
    tokens, so whether it is taken is fixed by the tree alone: u_j < p_par(x_j) / (1 − the
    mass of its earlier siblings' distinct tokens), 0 for a token an earlier sibling had. A
    node is accepted when it and every ancestor is the first of its siblings taken (doubling
    up the parent pointers); the last token comes from the deepest accepted node's row less
    its children's tokens. Root → children tokens 5, 7 with p 0.5, 0.3: try 5 (u < 0.5), then
    7 with u < 0.3 / 0.5; neither → p = 1 − 0.8 mass spread over the rest.
    A greedy row is one-hot p: the argmax child is accepted, and the last token is the argmax.
    """
    b, t = p.shape[:2]
    dev = p.device
    rows = torch.arange(b, device=dev)[:, None]
    order = torch.arange(t, device=dev)
    real = parents >= 0  # nodes past the root (not the root, not padding)
    up = parents.clamp(min=0)  # [B, T]; the root and padding point at the root
    px = p[rows, up, tokens] * real  # [B, T]: p of the parent's row at the node's token
    # [B, j, s]: s is an earlier sibling of j
    sibling = real[:, :, None] & real[:, None, :] & (parents[:, :, None] == parents[:, None, :])
    sibling &= order[None, None, :] < order[None, :, None]
    repeat = (sibling & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [B, T]
    removed = (sibling.to(p.dtype) * (px * ~repeat)[:, None, :]).sum(-1)
    take = real & ~repeat & (u * (1.0 - removed).clamp_min(1e-30) < px)
    first = take & ~(sibling & take[:, None, :]).any(-1)
    path = first.clone()
    path[:, 0] = True  # the root, always reached
    for _ in range(max(t - 1, 1).bit_length()):  # doubling: 2^k ancestors checked
        path &= path.gather(1, up)
        up = up.gather(1, up)
    accepted = path & real
    node = (accepted * order).amax(-1)  # the deepest accepted (children after parents); 0: root
    current = p[rows[:, 0], node]  # [B, V]
    children = real & (parents == node[:, None])  # all tried and rejected
    rejected = torch.zeros_like(current).scatter_reduce_(
        -1, tokens, children.to(current.dtype), reduce="amax"
    )  # 1 at the children's tokens
    return accepted, sample_rows(residual(current, current * rejected), u[:, 0])
