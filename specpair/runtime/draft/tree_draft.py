"""Tree drafting, EAGLE-2 style: `topk` candidates per expanded node for `steps` steps, the
`topk` best frontier nodes (by cumulative draft log-probability) expanded at each step, then
the best `num_draft_tokens` of all candidates kept as the tree.

    steps 3, topk 2: the root's top 2 → depth 1 (both expanded); their 2 × 2 children → the
    best 2 of those expanded; their 2 × 2 children: 2 + 4 + 4 = 10 candidates, the best
    num_draft_tokens kept. A kept node's score (its path's log-probability) is at most its
    parent's, so the best n of them always hold every kept node's parent (ties: shallower first).

The draft's KV of a tree is tentative like a chain's (never committed: the next round's
appended tokens overwrite it). Nodes of one depth are siblings that must not see one another,
and a layout shows every position before its start to all its rows, so each step *recomputes*:
step d runs every expanded node so far (d · topk rows, in the order they were expanded) from
the committed length with their tree mask, written over the previous step's rows with the same
values, and reads the last topk rows' outputs. It costs topk · d rows at step d (a chain: one)
and needs nothing of the attention backends beyond the target's tree mask.

Sampled requests draft the same way from their temperature-scaled distribution: the target
verifies such a tree with SGLang's target-only rule (`accept.accept_trees`), which needs no q
and is exact for candidates chosen by any rule that does not look at the target's draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.runtime.draft.extend import DraftForward
from specpair.runtime.layout import BatchLayout
from specpair.runtime.sampling import RowParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftSampling
from specpair.runtime.tree import CandidateTree


def log_probs(logits: Tensor, params: RowParams | None) -> Tensor:
    """[R, V] draft log-probabilities that rank the candidates: a sampled request's at its
    temperature (a greedy one's at 1)."""
    x = logits.float()
    if params is not None:
        x = x / params.to(x.device).temperature
    return torch.log_softmax(x, -1)


def draft_trees(
    drafter: DraftForward,
    hidden: Tensor,
    slots: list[int],
    shape: TreeShape,
    sampling: DraftSampling | None = None,
    depths: Sequence[int] | None = None,
) -> list[CandidateTree]:
    """A tree of `shape` per request from its last hidden [B, 1, H] (the extend's, at the
    root), on the device; `depths[b]` caps request b's tree (default `shape.steps`). The host
    reads the candidates back once, at the end."""
    b, k, dev = len(slots), shape.topk, hidden.device
    cache = drafter.cache
    starts = torch.tensor([cache.lengths[s] for s in slots])
    rows_b = torch.arange(b, device=dev)[:, None]
    params = None if sampling is None else sampling.params  # a row per request
    repeated = None if params is None else params.repeat(k)  # a row per frontier node
    logp = log_probs(drafter.logits(hidden), params)  # [B, V]
    scores, tokens = logp.topk(k, -1)  # [B, k]: depth 1
    pool_tokens, pool_scores, pool_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
    frontier = torch.arange(k, device=dev).expand(b, k)  # pool index of each expanded node
    fw_tokens = tokens  # [B, d·k] the expanded nodes, in order
    fw_parent = torch.full((b, k), -1, dtype=torch.long, device=dev)  # row of each one's parent
    fw_feats = hidden.expand(b, k, hidden.shape[-1])  # EAGLE: each row's parent hidden
    mask = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    offset = k
    for d in range(1, shape.steps):
        t = d * k
        for slot, start in zip(slots, starts.tolist(), strict=True):
            cache.check_room(slot, start, t)
        positions = starts[:, None] + torch.arange(t) // k  # depth-1 nodes at the start
        layout = BatchLayout(torch.tensor(slots), starts, mask.cpu())
        feats = fw_feats if drafter.needs_features else None
        out = drafter.forward(fw_tokens, feats, positions.to(dev), cache.bind(layout))
        last = out[:, -k:]  # [B, k, H]: the frontier's outputs
        step = log_probs(drafter.logits(last.reshape(b * k, 1, -1)), repeated)
        child_scores, child_tokens = step.view(b, k, -1).topk(k, -1)  # [B, k, k]
        child_scores = (scores[:, :, None] + child_scores).view(b, k * k)
        child_tokens = child_tokens.view(b, k * k)
        pool_tokens.append(child_tokens)
        pool_scores.append(child_scores)
        pool_parents.append(frontier.repeat_interleave(k, -1))
        if d + 1 == shape.steps:
            break
        scores, pick = child_scores.topk(k, -1)  # the next frontier, [B, k]
        frontier = offset + pick
        offset += k * k
        parent_row = (d - 1) * k + pick // k  # [B, k]: rows of the frontier being expanded
        fw_tokens = torch.cat([fw_tokens, child_tokens.gather(-1, pick)], -1)
        fw_parent = torch.cat([fw_parent, parent_row], -1)
        fw_feats = torch.cat([fw_feats, last[rows_b, pick // k]], 1)
        mask = _grow(mask, parent_row)
    depth_of = torch.cat([torch.full((k,), 1)] + [torch.full((k * k,), j + 2) for j in
                         range(len(pool_tokens) - 1)])  # fmt: skip
    host = [torch.cat(x, -1).cpu() for x in (pool_tokens, pool_scores, pool_parents)]
    caps = list(depths) if depths is not None else [shape.steps] * b
    return [
        _rerank(host[0][i], host[1][i], host[2][i], depth_of, shape.num_draft_tokens, caps[i])
        for i in range(b)
    ]


def _grow(mask: Tensor, parent_row: Tensor) -> Tensor:
    """The tree mask [B, t, t] of the expanded rows, k more rows appended, each seeing its
    parent row's ancestors and itself."""
    b, t, _ = mask.shape
    k = parent_row.shape[1]
    rows = mask.gather(1, parent_row[..., None].expand(b, k, t))  # [B, k, t]
    grown = torch.zeros(b, t + k, t + k, dtype=torch.bool, device=mask.device)
    grown[:, :t, :t] = mask
    grown[:, t:, :t] = rows
    grown[:, t:, t:] = torch.eye(k, dtype=torch.bool, device=mask.device)
    return grown


def _rerank(
    tokens: Tensor, scores: Tensor, parents: Tensor, depth: Tensor, n: int, cap: int
) -> CandidateTree:
    """The best `n` candidates of depth at most `cap` as a tree, in depth order (a parent
    before its children). tokens, scores, parents (pool index, -1: the root), depth: [P]."""
    ok = (depth <= cap).nonzero()[:, 0].tolist()
    s, dep = scores.tolist(), depth.tolist()
    best = sorted(ok, key=lambda i: (-s[i], dep[i], i))[:n]
    kept = sorted(best, key=lambda i: (dep[i], -s[i], i))
    index = {node: j for j, node in enumerate(kept)}
    par = parents.tolist()
    tok = tokens.tolist()
    return CandidateTree(
        tuple(tok[i] for i in kept), tuple(-1 if par[i] < 0 else index[par[i]] for i in kept)
    )
