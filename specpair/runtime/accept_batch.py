"""The accept of a verified batch, batched on the logits' device: sampled chains and trees
drafted without q, each over its rows' candidates where their cuts allow (`candidate_probs`:
a row's 1024 likeliest tokens, not the 128 256 of a Llama-3 vocabulary), else over the
vocabulary; the rules themselves are `accept.py`'s. An accept graph (`gpu/verify_graphs.py`)
replays the candidates' form; the eager functions here run it first and fall back to the
vocabulary for a batch it does not cover.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import specpair.runtime.accept as rules  # the rules by module: tests swap in broken ones
from specpair.runtime.sampling import RowParams, candidate_probs, warp_rows
from specpair.runtime.tree import CandidateTree


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


@dataclass(frozen=True, slots=True)
class TreeBatch:
    """B trees drafted without q as `accept_trees` takes them, on the host."""

    params: RowParams  # B * T rows: each request's sampling, once per tree row
    tokens: Tensor  # [B, T] full-tree tokens (column 0, the root, unused)
    parents: Tensor  # [B, T] full-tree parents (-1: the root, or padding)
    u: Tensor  # [B, T] uniforms, from each request's generator


def candidate_rows(logits: Tensor, params: RowParams) -> tuple[Tensor, Tensor, Tensor]:
    """The warped rows of logits [B, T, V] over their candidates: (ids [B, T, c], p
    [B, T, c + 1], covered [B, T]: the row's cut among its candidates). Greedy rows are
    one-hot at their first argmax. Column c holds no mass: a token off a row's candidates is
    looked up there, so p(x) = 0 for it, as over the vocabulary."""
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    ids, p, covered = candidate_probs(flat.float() / params.temperature, params)
    c = ids.shape[-1]
    if params.any_greedy:
        hit = ids == flat.argmax(-1, keepdim=True)
        first = hit & (hit.cumsum(-1) == 1)  # ids are distinct; the guard costs nothing
        p = torch.where(params.greedy[:, None], first.to(p.dtype), p)
        covered = torch.where(params.greedy, hit.any(-1), covered)
    p = torch.nn.functional.pad(p, (0, 1)).view(b, t, c + 1)
    return ids.view(b, t, c), p, covered.view(b, t)


def _column(ids: Tensor, p: Tensor, tokens: Tensor) -> Tensor:
    """Where each token lies among the candidates of the row it is judged by: ids [..., c],
    p [..., c + 1], tokens [...] → columns [...], c where it has no mass there."""
    c = ids.shape[-1]
    match = (ids == tokens[..., None]) & (p[..., :c] > 0)
    return torch.where(match.any(-1), match.to(torch.int32).argmax(-1), c)


def accept_candidates(
    logits: Tensor,
    params: RowParams,
    drafts: Tensor,
    lengths: Tensor,
    u: Tensor,
    q_ids: Tensor,
    q: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`accept_chains` over each row's candidates rather than the vocabulary: (accepted
    [B], last token [B], covered [B]); a request not covered (a row up to its chain's end
    with its cut past the candidates) needs the warp over the vocabulary. For batches whose
    sampled rows filter (top-k, top-p or min-p), greedy rows among them. A tier-7 chain's
    rows are 8 × 257 floats, not 8 × 128 256.

    logits: [B, n + 1, V]; params: B × (n + 1) rows; q_ids, q: [B, n, K], q sparse (padding:
    probability 0); drafts, lengths, u as `accept_chains` takes them. A draft off the
    candidates has p(x) = 0 (column c) and is rejected as over the vocabulary; q's mass off
    them lies where (p − q)+ is 0 either way, so the residual is the same distribution.
    """
    n = logits.shape[1] - 1
    ids, p, covered = candidate_rows(logits, params)
    # q on the candidates: [B, n, K, c] matches of q's ids, summed over K; 0 in column c
    qc = (q[..., None] * (q_ids[..., None] == ids[:, :n, None, :])).sum(-2)
    where = _column(ids[:, :n], p[:, :n], drafts)
    accepted, last = rules.accept_chains(p, torch.nn.functional.pad(qc, (0, 1)), where, lengths, u)
    rows = torch.arange(len(ids), device=logits.device)
    token = ids[rows, accepted].gather(-1, last.clamp(max=ids.shape[-1] - 1)[:, None])[:, 0]
    # rows past a chain's end (padding: their logits may be flat) are never read
    past = torch.arange(n + 1, device=logits.device) > lengths[:, None]
    return accepted, token, (covered | past).all(-1)


def accept_tree_candidates(
    logits: Tensor, params: RowParams, tokens: Tensor, parents: Tensor, u: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`accept_trees` over each row's candidates: (accepted [B, T] bool, last token [B],
    covered [B]), the arguments as `accept_trees` takes them but logits [B, T, V] and the
    rows' `params`. Node j's token is judged by its parent's row, so it is looked up among
    that row's candidates; the last token is drawn from the deepest accepted node's row.
    Removing a token off the candidates (column c, no mass) leaves p as it was, as over the
    vocabulary."""
    ids, p, covered = candidate_rows(logits, params)
    b, t, c = ids.shape
    up = parents.clamp(min=0)[..., None]
    columns = _column(
        ids.gather(1, up.expand(b, t, c)), p.gather(1, up.expand(b, t, c + 1)), tokens
    )
    accepted, last = rules.accept_trees(p, columns, parents, u)
    node = (accepted * torch.arange(t, device=ids.device)).amax(-1)  # 0: none accepted
    rows = torch.arange(b, device=ids.device)
    token = ids[rows, node].gather(-1, last.clamp(max=c - 1)[:, None])[:, 0]
    padding = parents < 0  # past the tree's end, never read (the root, column 0, always is)
    padding[:, 0] = False
    return accepted, token, (covered | padding).all(-1)


def accept_tree_batch(logits: Tensor, trees: TreeBatch) -> list[list[int]]:
    """`accept_trees` of a batch's trees drafted without q (greedy requests among them),
    eagerly on the logits' device: per request [last token, accepted full-tree nodes…]."""
    b, t, v = logits.shape
    dev = logits.device
    params = trees.params.to(dev)
    tokens, parents, u = trees.tokens.to(dev), trees.parents.to(dev), trees.u.to(dev)
    covered = None
    if not params.any_plain:
        accepted, last, covered = accept_tree_candidates(logits, params, tokens, parents, u)
    if covered is None or not bool(covered.all()):
        p = warp_rows(logits.reshape(b * t, v), params).view(b, t, v)
        accepted, last = rules.accept_trees(p, tokens, parents, u)
    return [
        [bonus, *(j for j, ok in enumerate(row) if ok)]
        for row, bonus in zip(accepted.cpu().tolist(), last.tolist(), strict=True)
    ]


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
    accepted, last = rules.accept_chains(p, q, drafts, lengths, u)
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
    full: list[tuple[int, Tensor, Tensor]] = []  # q filling [n, width]: copied in one go
    for i, (drafted_greedily, tree) in enumerate(zip(greedy, trees, strict=True)):
        m = len(tree)
        if drafted_greedily or tree.draft_probs is None or not m:
            continue
        if tree.draft_ids is None:
            probs[i, :m, 0] = 0.0
            dense.append((i, tree.draft_probs))
            continue
        if tree.draft_ids.shape == (n, width):
            full.append((i, tree.draft_ids, tree.draft_probs))
        else:
            k = tree.draft_ids.shape[1]
            ids[i, :m, :k], probs[i, :m, :k] = tree.draft_ids, tree.draft_probs
    if full:
        rows, row_ids, row_probs = zip(*full, strict=True)
        ids[list(rows)] = torch.stack(row_ids).long()
        probs[list(rows)] = torch.stack(row_probs).float()
    return ids, probs, tuple(dense)
