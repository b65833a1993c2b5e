"""The accept step of a verify: which acceptance rule a batch's trees take.

all greedy                  accept_greedy_argmax per tree (the longest argmax path)
sampled, all chains         accept_chains, batched (a graph's on a GPU); a chain without q
                            is one-hot q, SGLang's target-only rule
sampled trees without q     accept_trees, batched (a graph's on a GPU): SGLang's target-only
                            rule (the draft's tree shapes send no q)
sampled trees with q        accept_sampling per request: the host reference (SpecInfer
                            with per-node q)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from specpair.runtime.accept import Acceptance, accept_greedy_argmax, accept_sampling
from specpair.runtime.accept_batch import (
    ChainBatch,
    TreeBatch,
    accept_chain_batch,
    accept_tree_batch,
    sparse_q,
)
from specpair.runtime.sampling import RowParams, SamplingParams, warp
from specpair.runtime.tree import CandidateTree, full_parents


class TargetSequence(Protocol):
    """What the accept reads of a request (`worker.TargetSequence`)."""

    sampling: SamplingParams
    generator: torch.Generator


# The verify stage's accept graph (`VerifyStage.accept`; None: accept eagerly)
GraphAccept = Callable[[ChainBatch | TreeBatch], "list[list[int]] | None"]
# Where a verify's accept ran: the argmax alone; a sampled batch in an accept graph, or in
# batched ops on the logits' device (no graph fits, or a row's cut lies past its candidates);
# on the host request by request (trees with q, the batch-invariant mode)
ACCEPT_PATHS = ("greedy", "graph", "device", "host")


def accept_batch(
    seqs: Sequence[TargetSequence],
    trees: Sequence[CandidateTree],
    logits: Tensor,
    t: int,
    graph: GraphAccept,
    per_request: bool = False,
) -> tuple[list[Acceptance], str]:
    """Each request's acceptance of its tree from the verify's logits [B, t, V], and the path
    it took (`ACCEPT_PATHS`). `per_request`: the batch-invariant mode samples on the host,
    request by request (the batched accept's GPU kernels, and its graph up to a bucket,
    follow the batch's shape)."""
    sampled = not all(s.sampling.greedy for s in seqs)
    chains = None  # the host's part of the accept runs while the GPU verifies
    if sampled and not per_request and all(tree.is_chain() for tree in trees):
        chains = chain_inputs(seqs, trees, t)
    if not sampled:
        return accept_greedy_batch(trees, logits.argmax(-1)), "greedy"
    batch: ChainBatch | TreeBatch | None = chains
    if chains is None and not per_request and all(tree.draft_probs is None for tree in trees):
        batch = tree_inputs(seqs, trees, t)  # drafted without q
    if batch is not None:
        verdicts = graph(batch)
        path = "device" if verdicts is None else "graph"
        if isinstance(batch, TreeBatch):
            verdicts = verdicts or accept_tree_batch(logits, batch)
            return [tree_acceptance(tree, v) for tree, v in zip(trees, verdicts, strict=True)], path
        verdicts = verdicts or accept_chain_batch(logits, batch)
        return [
            Acceptance(tuple(range(m)), tree.tokens[:m], bonus)
            for tree, (m, bonus) in zip(trees, verdicts, strict=True)
        ], path
    host = logits.cpu()  # sampled trees with q (or per request): the host, request by request
    return [
        accept_greedy_argmax(tree, host[i, : len(tree) + 1].argmax(-1).tolist())
        if seq.sampling.greedy
        else accept_sampling(tree, warp(host[i, : len(tree) + 1], seq.sampling), seq.generator)
        if tree.draft_probs is not None or not len(tree)
        else tree_acceptance(
            tree,
            accept_tree_batch(
                host[i : i + 1, : len(tree) + 1], tree_inputs([seq], [tree], len(tree) + 1)
            )[0],
        )
        for i, (seq, tree) in enumerate(zip(seqs, trees, strict=True))
    ], "host"


def accept_greedy_batch(trees: Sequence[CandidateTree], argmax: Tensor) -> list[Acceptance]:
    """Each tree's greedy acceptance from the target's argmax [B, T] (all greedy acceptance
    needs), read back in one call: a row each, walking each tree's children, cost 64 tier-7
    chains 1.58 ms of host time against 0.32 (2-core CPU, `bench.round_overhead host`)."""
    rows = argmax.tolist()
    return [accept_greedy_argmax(tree, rows[i]) for i, tree in enumerate(trees)]


def tree_inputs(
    seqs: Sequence[TargetSequence], trees: Sequence[CandidateTree], t: int
) -> TreeBatch:
    """What `accept_trees` needs of a batch of trees besides the logits, on the host: full
    trees padded to t, each sampling request's uniforms from its generator."""
    b = len(seqs)
    tokens = torch.zeros(b, t, dtype=torch.long)
    parents = torch.full((b, t), -1, dtype=torch.long)
    for i, tree in enumerate(trees):
        tokens[i, 1 : len(tree) + 1] = torch.tensor(tree.tokens, dtype=torch.long)
        parents[i, : len(tree) + 1] = torch.tensor(full_parents(tree))
    u = batch_uniforms(seqs, [len(tree) + 1 for tree in trees], t)
    return TreeBatch(RowParams.of([s.sampling for s in seqs]).repeat(t), tokens, parents, u)


def tree_acceptance(tree: CandidateTree, verdict: list[int]) -> Acceptance:
    """A tree's `Acceptance` from its verdict [last token, accepted full-tree nodes…]."""
    nodes = tuple(j - 1 for j in verdict[1:])
    return Acceptance(nodes, tuple(tree.tokens[n] for n in nodes), verdict[0])


def chain_inputs(
    seqs: Sequence[TargetSequence], trees: Sequence[CandidateTree], t: int
) -> ChainBatch:
    """What rejection sampling needs of a batch of chains besides the logits, on the
    host: each request's uniforms drawn from its generator, its q sparse."""
    b, n = len(seqs), t - 1
    lengths = [len(tree) for tree in trees]
    # one tensor from padded rows: a tensor per request cost a third of this at batch 16
    padded = [(*tree.tokens, *(0,) * (n - m)) for tree, m in zip(trees, lengths, strict=True)]
    drafts = torch.tensor(padded, dtype=torch.long).view(b, n)
    u = batch_uniforms(seqs, [m + 1 for m in lengths], t)
    q_ids, q, dense = sparse_q([s.sampling.greedy for s in seqs], trees, drafts)
    return ChainBatch(
        params=RowParams.of([s.sampling for s in seqs]).repeat(t),
        drafts=drafts,
        lengths=torch.tensor(lengths),
        u=u,
        q_ids=q_ids,
        q=q,
        dense=dense,
    )


def batch_uniforms(seqs: Sequence[TargetSequence], counts: Sequence[int], t: int) -> Tensor:
    """[B, t]: row i's first counts[i] uniforms from request i's generator (`uniforms`), 0.5
    elsewhere and in a greedy request's row (its verdicts need no randomness). One scatter of
    the draws: a row assignment per request cost half of this at batch 64 (2-core CPU: 834
    against 447 µs, 291 of it the draws)."""
    u = torch.full((len(seqs), t), 0.5)
    taken = [0 if s.sampling.greedy else n for s, n in zip(seqs, counts, strict=True)]
    drawn = [uniforms(s, n) for s, n in zip(seqs, taken, strict=True) if n]
    if drawn:
        u.masked_scatter_(torch.arange(t) < torch.tensor(taken)[:, None], torch.cat(drawn))
    return u


def uniforms(seq: TargetSequence, n: int) -> Tensor:
    """n uniforms in [0, 1) from the request's own generator: what its seeded tokens depend
    on, whatever batch it runs in."""
    return torch.rand(n, generator=seq.generator)
