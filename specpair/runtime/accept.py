"""Verification as pure functions: which draft nodes the target accepts, and the bonus token.

Both work on the full tree (root = the request's last token at index 0, draft node i at
i + 1) and on per-node target scores, row j being the target's prediction *after* node j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpair.runtime.sampling import (
    RowParams,
    candidate_probs,
    sample,
    sample_rows,
    warp_rows,
)  # fmt: skip
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


@dataclass(frozen=True, slots=True)
class ChainBatch:
    """B chains of up to n drafts as `accept_chains` takes them, on the host (an accept graph
    loads them into its buffers, the eager accept copies them to the logits' device)."""

    params: RowParams  # B * (n + 1) rows: each request's sampling, once per tree row
    drafts: Tensor  # [B, n]
    lengths: Tensor  # [B] drafts per chain
    u: Tensor  # [B, n + 1] uniforms, from each request's generator
    q_ids: Tensor  # [B, n, K]: q sparse (a greedy request's: one-hot at its drafts)
    q: Tensor  # [B, n, K]
    dense: tuple[tuple[int, Tensor], ...] = ()  # (request, q [m, V]) that came dense


def accept_greedy(tree: CandidateTree, target_logits: Tensor) -> Acceptance:
    """Longest path whose tokens equal the target argmax; bonus = argmax after it.

    target_logits: [n + 1, V] over the full tree.
    """
    return accept_greedy_argmax(tree, target_logits.argmax(-1).tolist())


def accept_greedy_argmax(tree: CandidateTree, argmax: Sequence[int]) -> Acceptance:
    """`accept_greedy` given the target's argmax per full-tree node ([n + 1] token ids)."""
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
    with children x1, x2, … (drawn i.i.d. from the same q, as SpecInfer requires):
      accept x with probability min(1, p(x) / q(x)) — q ≤ p: always accept;
      on rejection p ← normalize((p − q)+) and try the next sibling;
      when no child is accepted the bonus is sampled from the current p.
    For a chain this is the standard rejection sampler of Leviathan et al. / Chen et al. With
    q left unchanged after a rejection it is exact for i.i.d. siblings, not for siblings drawn
    without replacement; the tree shapes' trees carry no q and take `accept_trees`.
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


def accept_candidates(
    logits: Tensor,
    params: RowParams,
    drafts: Tensor,
    lengths: Tensor,
    u: Tensor,
    q_ids: Tensor,
    q: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`accept_chains` over each row's candidates (`candidate_probs`) rather than the
    vocabulary: (accepted [B], last token [B], covered [B]); a request whose rows' cuts do
    not all fall among their candidates is not covered, and its verdict needs the warp over
    the vocabulary. For rows with top-k, top-p or min-p, and greedy rows (one-hot at the
    first argmax). On a Llama-3 vocabulary a tier-7 chain's rows are 8 × 257 floats, not
    8 × 128 256, so the work is the candidates' topk and one normaliser over the row.

    logits: [B, n + 1, V]; params: B × (n + 1) rows; q_ids, q: [B, n, K], q sparse (padding:
    probability 0); drafts, lengths, u as `accept_chains` takes them. Column c (past the c
    candidates) holds no mass: a draft off the candidates lands there, p(x) = 0, rejected as
    over the vocabulary; q's mass off them falls where (p − q)+ is 0 either way, so the
    residual is the same distribution.
    """
    b, t, v = logits.shape
    n = t - 1
    flat = logits.reshape(b * t, v)
    ids, p, covered = candidate_probs(flat.float() / params.temperature, params)
    c = ids.shape[-1]
    if params.any_greedy:
        hit = ids == flat.argmax(-1, keepdim=True)
        first = hit & (hit.cumsum(-1) == 1)  # ids are distinct; the guard costs nothing
        p = torch.where(params.greedy[:, None], first.to(p.dtype), p)
        covered = torch.where(params.greedy, hit.any(-1), covered)
    ids, p = ids.view(b, t, c), torch.nn.functional.pad(p, (0, 1)).view(b, t, c + 1)
    # q on the candidates: [B, n, K, c] matches of q's ids, summed over K
    qc = (q[..., None] * (q_ids[..., None] == ids[:, :n, None, :])).sum(-2)
    match = (ids[:, :n] == drafts[..., None]) & (p[:, :n, :c] > 0)  # [B, n, c]
    where = torch.where(match.any(-1), match.to(torch.int32).argmax(-1), c)
    accepted, last = accept_chains(p, torch.nn.functional.pad(qc, (0, 1)), where, lengths, u)
    rows = torch.arange(b, device=logits.device)
    token = ids[rows, accepted].gather(-1, last.clamp(max=c - 1)[:, None])[:, 0]
    return accepted, token, covered.view(b, t).all(-1)


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
    (sampling p by elimination), whatever candidates the draft chose. Children come after
    their parent, so one pass over the nodes in order visits each node's children in order,
    after the node itself was accepted: at node 5, parent 2, accepted 2 → try 5; else skip.
    A greedy row is one-hot p: the argmax child is accepted, and the last token is the argmax.
    """
    b, t, _ = p.shape
    rows = torch.arange(b, device=p.device)
    node = torch.zeros(b, dtype=torch.long, device=p.device)
    current = p[:, 0].clone()  # [B, V]
    accepted = torch.zeros(b, t, dtype=torch.bool, device=p.device)
    for j in range(1, t):
        x = tokens[:, j]
        tried = parents[:, j] == node
        px = current[rows, x]
        take = tried & (u[:, j] < px)
        drop = tried & ~take
        accepted[:, j] = take
        node = torch.where(take, j, node)
        removed = current.scatter(-1, x[:, None], 0.0)  # norm((p − onehot(x))+)
        total = removed.sum(-1, keepdim=True)
        removed = torch.where(total > 0, removed / total.clamp_min(1e-30), current)
        current = torch.where(take[:, None], p[:, j], torch.where(drop[:, None], removed, current))
    return accepted, sample_rows(current, u[:, 0])


def accept_tree_batch(
    logits: Tensor, trees: Sequence[CandidateTree], u: Tensor, params: RowParams
) -> list[Acceptance]:
    """`accept_trees` for a batch's trees drafted without q (greedy requests among them),
    eagerly on the logits' device [B, T, V]; u: [B, T] on the host."""
    b, t, v = logits.shape
    dev = logits.device
    p = warp_rows(logits.reshape(b * t, v), params.repeat(t).to(dev)).view(b, t, v)
    tokens = torch.zeros(b, t, dtype=torch.long)
    parents = torch.full((b, t), -1, dtype=torch.long)
    for i, tree in enumerate(trees):
        tokens[i, 1 : len(tree) + 1] = torch.tensor(tree.tokens, dtype=torch.long)
        parents[i, : len(tree) + 1] = torch.tensor(full_parents(tree))
    accepted, last = accept_trees(p, tokens.to(dev), parents.to(dev), u.to(dev))
    out = []
    for tree, row, bonus in zip(trees, accepted.cpu().tolist(), last.tolist(), strict=True):
        nodes = tuple(j - 1 for j, ok in enumerate(row) if ok)
        out.append(Acceptance(nodes, tuple(tree.tokens[n] for n in nodes), bonus))
    return out


def accept_chain_batch(logits: Tensor, chains: ChainBatch) -> list[list[int]]:
    """Rejection sampling of a batch of chains (greedy requests among them too), eagerly on
    the logits' device: per request [accepted drafts, last token]."""
    b, t, v = logits.shape
    dev = logits.device
    params = chains.params.to(dev)
    drafts, lengths, u = chains.drafts.to(dev), chains.lengths.to(dev), chains.u.to(dev)
    q_ids, q_sparse = chains.q_ids.to(dev), chains.q.to(dev)
    if not params.any_plain and not chains.dense:
        accepted, last, covered = accept_candidates(
            logits, params, drafts, lengths, u, q_ids, q_sparse
        )
        if bool(covered.all()):
            return torch.stack([accepted, last], -1).tolist()
    p = warp_rows(logits.reshape(b * t, v), params).view(b, t, v)
    q = torch.zeros(b, t - 1, v, device=dev).scatter_add_(-1, q_ids, q_sparse)
    for i, rows in chains.dense:
        q[i, : len(rows)] = rows.to(dev)
    accepted, last = accept_chains(p, q, drafts, lengths, u)
    return torch.stack([accepted, last], -1).tolist()


def sparse_q(
    greedy: Sequence[bool], trees: Sequence[CandidateTree], drafts: Tensor
) -> tuple[Tensor, Tensor, tuple[tuple[int, Tensor], ...]]:
    """The q of a batch of chains as sparse rows (ids [B, n, K], probs [B, n, K]; padding
    adds 0 to token 0): each sampled request's own, a greedy request's one-hot at its drafts
    (see `accept_chains`); and the requests whose q came dense [m, V]."""
    b, n = drafts.shape
    width = max(
        (t.draft_ids.shape[1] for t in trees if t.draft_ids is not None and len(t)), default=1
    )
    ids = torch.zeros(b, n, width, dtype=torch.long)
    probs = torch.zeros(b, n, width)
    ids[..., 0], probs[..., 0] = drafts, 1.0
    dense: list[tuple[int, Tensor]] = []
    for i, (drafted_greedily, tree) in enumerate(zip(greedy, trees, strict=True)):
        m = len(tree)
        if drafted_greedily or tree.draft_probs is None or not m:
            continue
        if tree.draft_ids is None:
            probs[i, :m, 0] = 0.0
            dense.append((i, tree.draft_probs))
            continue
        k = tree.draft_ids.shape[1]
        ids[i, :m, :k], probs[i, :m, :k] = tree.draft_ids, tree.draft_probs
    return ids, probs, tuple(dense)
