"""Growing a tree shape's candidates on the device and choosing the tree (EAGLE-2 style, see
`draft/tree_draft.py`): the device half, shared by the eager draft and its CUDA graphs
(`gpu/tree_graphs.py`), and the host's rerank after the one read back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specpair.runtime.shape import TreeShape
from specpair.runtime.tree import CandidateTree


def log_probs(logits: Tensor, temperature: Tensor | None) -> Tensor:
    """[R, V] draft log-probabilities that rank the candidates: a sampled request's at its
    temperature [R, 1] (a greedy one's at 1; None: every row's at 1)."""
    x = logits.float()
    if temperature is not None:
        x = x / temperature
    return torch.log_softmax(x, -1)


# One tree step's forward: (tokens [B, t], EAGLE features [B, t, H] or None, positions [B, t]
# and tree mask [B, t, t], on the device) -> hidden [B, t, H], the t = d · topk expanded nodes
# written over the previous step's rows from each request's committed length.
StepForward = Callable[[Tensor, Tensor | None, Tensor, Tensor], Tensor]


def grow_tree(
    logits: Callable[[Tensor], Tensor],
    needs_features: bool,
    hidden: Tensor,
    starts: Tensor,
    shape: TreeShape,
    temperature: Tensor | None,
    forward: StepForward,
) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate pool of every request on the device, with no host work (a graph's body
    too): tokens, scores (path log-probabilities) and parents (pool index, -1: the root), each
    [B, P], P = topk + (steps - 1) · topk². `logits`: the drafter's (hidden [B, T, H] -> its
    last row's [B, V]); `needs_features`: an EAGLE head, fed each node's parent hidden; hidden
    [B, 1, H], starts [B] (device), temperature [B, 1] (a greedy row's 1; None: all greedy)."""
    b, k, dev = hidden.shape[0], shape.topk, hidden.device
    rows_b = torch.arange(b, device=dev)[:, None]
    per_node = None if temperature is None else temperature.repeat_interleave(k, 0)
    scores, tokens = log_probs(logits(hidden), temperature).topk(k, -1)  # depth 1
    pool_tokens, pool_scores, pool_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
    frontier = torch.arange(k, device=dev).expand(b, k)  # pool index of each expanded node
    fw_tokens = tokens  # [B, d·k] the expanded nodes, in order
    fw_feats = hidden.expand(b, k, hidden.shape[-1])  # EAGLE: each row's parent hidden
    mask = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    offset = k
    for d in range(1, shape.steps):
        t = d * k
        positions = starts[:, None] + torch.arange(t, device=dev) // k  # depth 1 at the start
        feats = fw_feats if needs_features else None
        last = forward(fw_tokens, feats, positions, mask)[:, -k:]  # [B, k, H]: the frontier
        step = log_probs(logits(last.reshape(b * k, 1, -1)), per_node)
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
        fw_feats = torch.cat([fw_feats, last[rows_b, pick // k]], 1)
        mask = _grow(mask, parent_row)
    return torch.cat(pool_tokens, -1), torch.cat(pool_scores, -1), torch.cat(pool_parents, -1)


def rerank_trees(
    pool: tuple[Tensor, Tensor, Tensor],
    shape: TreeShape,
    n: int,
    depths: Sequence[int] | None = None,
) -> list[CandidateTree]:
    """The trees of the pool's first `n` requests (`grow_tree`; rows past them are a graph's
    padding), read back once; `depths[b]` caps request b's tree (default `shape.steps`)."""
    k = shape.topk
    depth_of = torch.cat(
        [torch.full((k,), 1)] + [torch.full((k * k,), j + 2) for j in range(shape.steps - 1)]
    )
    caps = list(depths) if depths is not None else [shape.steps] * n
    host = [x[:n].cpu() for x in pool]
    return [
        _rerank(host[0][i], host[1][i], host[2][i], depth_of, shape.num_draft_tokens, caps[i])
        for i in range(n)
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
