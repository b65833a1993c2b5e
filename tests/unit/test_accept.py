"""Greedy and sampling acceptance as pure functions."""

from __future__ import annotations

import pytest
import torch

from specpair.runtime.accept import (
    accept_greedy,
    accept_greedy_argmax,
    accept_sampling,
    greedy_path,
)
from specpair.runtime.sampling import SamplingParams, make_generator
from specpair.runtime.target.accepting import batch_uniforms, uniforms
from specpair.runtime.tree import CandidateTree, chain


def one_hot_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_chain_stops_at_first_mismatch() -> None:
    tree = chain([4, 5, 6])
    # the target predicts 4 after the root, 5 after node 0, 9 after node 1 (draft said 6)
    acc = accept_greedy(tree, one_hot_logits([4, 5, 9, 1]))
    assert acc.tokens == (4, 5) and acc.nodes == (0, 1) and acc.bonus == 9
    assert acc.accept_length == 2 and acc.keep == [0, 1, 2]


def test_greedy_all_accepted_takes_bonus_after_last() -> None:
    acc = accept_greedy(chain([4, 5]), one_hot_logits([4, 5, 7]))
    assert acc.tokens == (4, 5) and acc.bonus == 7


def test_greedy_empty_tree_is_plain_decoding() -> None:
    acc = accept_greedy(CandidateTree((), ()), one_hot_logits([3]))
    assert acc.tokens == () and acc.bonus == 3 and acc.keep == [0]


def test_greedy_tree_follows_the_matching_branch() -> None:
    # root → {a=1, b=2}; b → {c=3}; full indices: root 0, a 1, b 2, c 3
    tree = CandidateTree((1, 2, 3), (-1, -1, 1))
    acc = accept_greedy(tree, one_hot_logits([2, 0, 3, 8]))
    assert acc.nodes == (1, 2) and acc.tokens == (2, 3) and acc.bonus == 8
    assert acc.keep == [0, 2, 3]  # non-contiguous in the full tree


def test_sampling_needs_draft_probs() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampling(chain([1]), torch.full((2, 4), 0.25), None)


def test_sampling_accepts_when_q_equals_p_and_rejects_impossible_tokens() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    same = accept_sampling(chain([1], p[None].clone()), torch.stack([p, p]), gen)
    assert same.tokens == (1,)
    q = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rejected = accept_sampling(chain([2], q[None]), torch.stack([p, p]), gen)
    # p(2) = 0: always rejected; the residual (p - q)+ is p itself
    assert rejected.tokens == () and rejected.bonus in (0, 1)


def test_accept_trees_greedy_rows_take_the_argmax_path() -> None:
    """One-hot p (greedy rows): the target-only rule accepts the argmax child, as
    `accept_greedy_argmax` does, and the last token is the argmax."""
    from specpair.runtime.accept import accept_greedy_argmax
    from specpair.runtime.accept_batch import TreeBatch, accept_tree_batch
    from specpair.runtime.sampling import RowParams, SamplingParams
    from specpair.runtime.target.accepting import tree_acceptance
    from specpair.runtime.tree import full_parents

    torch.manual_seed(0)
    tree = CandidateTree((3, 1, 4, 1, 5), (-1, -1, 0, 1, 2))
    logits = torch.randn(2, 6, 8)
    logits[0, 0, 1] = logits[0, 2, 1] = 9.0  # root → node 1 (token 1) → node 3 (token 1)
    tokens = torch.tensor([[0, *tree.tokens]] * 2)
    parents = torch.tensor([full_parents(tree)] * 2)
    params = RowParams.of([SamplingParams()] * 2).repeat(6)
    verdicts = accept_tree_batch(logits, TreeBatch(params, tokens, parents, torch.rand(2, 6)))
    accs = [tree_acceptance(tree, v) for v in verdicts]
    for acc, row in zip(accs, logits, strict=True):
        assert acc == accept_greedy_argmax(tree, row.argmax(-1).tolist())
    assert accs[0].nodes == (1, 3)


def test_accept_trees_samples_p_by_elimination() -> None:
    """A root with three children: the outcome (accepted child or last token) is p."""
    from specpair.runtime.accept import accept_trees

    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    n = 200_000
    tokens = torch.tensor([0, 1, 3, 2]).expand(n, 4)
    parents = torch.tensor([-1, 0, 0, 0]).expand(n, 4)
    accepted, last = accept_trees(
        p.expand(n, 4, 4).clone(),
        tokens,
        parents,
        torch.rand(n, 4, generator=torch.Generator().manual_seed(1)),
    )
    first = torch.where(
        accepted.any(-1), tokens.gather(1, accepted.long().argmax(-1, keepdim=True))[:, 0], last
    )
    freq = torch.bincount(first, minlength=4).float() / n
    assert torch.allclose(freq, p, atol=0.005), freq


def sequential_trees(p, tokens, parents, u):  # type: ignore[no-untyped-def]
    """The target-only rule as its definition reads, node by node: at the current node try
    its children in order, p(x) to take one, else remove x from p and renormalise."""
    b, t, _ = p.shape
    rows = torch.arange(b)
    node = torch.zeros(b, dtype=torch.long)
    current = p[:, 0].clone()
    accepted = torch.zeros(b, t, dtype=torch.bool)
    for j in range(1, t):
        x = tokens[:, j]
        tried = parents[:, j] == node
        take = tried & (u[:, j] < current[rows, x])
        drop = tried & ~take
        accepted[:, j] = take
        node = torch.where(take, j, node)
        removed = current.scatter(-1, x[:, None], 0.0)
        total = removed.sum(-1, keepdim=True)
        removed = torch.where(total > 0, removed / total.clamp_min(1e-30), current)
        current = torch.where(take[:, None], p[:, j], torch.where(drop[:, None], removed, current))
    return accepted, current


def test_accept_trees_without_a_loop_is_the_rule_node_by_node() -> None:
    """Same uniforms, same accepted nodes, and the last token drawn from the same p, over
    random trees with duplicate siblings, zero-mass tokens and one-hot (greedy) rows."""
    from specpair.runtime.accept import accept_trees
    from specpair.runtime.sampling import sample_rows

    gen = torch.Generator().manual_seed(3)
    b, t, v = 4000, 9, 6
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4]).expand(b, t).clone()
    parents[::7, 7:] = -1  # shorter trees: padding past their end
    tokens = torch.randint(0, v, (b, t), generator=gen)
    p = torch.softmax(torch.randn(b, t, v, generator=gen) * 2, -1)
    p[::5] = p[::5].masked_fill(p[::5] < 0.15, 0.0)  # zero-mass tokens
    p[::11] = torch.nn.functional.one_hot(p[::11].argmax(-1), v).float()
    p = p / p.sum(-1, keepdim=True)
    u = torch.rand(b, t, generator=gen)
    accepted, last = accept_trees(p, tokens, parents, u)
    ref_accepted, ref_current = sequential_trees(p, tokens, parents, u)
    assert torch.equal(accepted, ref_accepted)
    assert accepted[:, 1:].any(-1).float().mean() > 0.3  # the trees do accept
    assert (last == sample_rows(ref_current, u[:, 0])).float().mean() > 0.999


def test_batch_uniforms_draw_each_sampled_rows_own_and_only_its_count() -> None:
    """Row i holds request i's next counts[i] uniforms, as `uniforms` alone would draw them
    (seeded tokens do not depend on the batch); greedy rows and the padding hold 0.5, and no
    generator is advanced past its count."""

    class Seq:
        def __init__(self, temperature: float, seed: int) -> None:
            self.sampling = SamplingParams(temperature=temperature, seed=seed)
            self.generator = make_generator(seed)

    seqs = [Seq(0.7, 1), Seq(0.0, 2), Seq(0.7, 3)]
    u = batch_uniforms(seqs, [3, 4, 5], 6)
    first, third = make_generator(1), make_generator(3)
    assert torch.equal(u[0, :3], torch.rand(3, generator=first))
    assert torch.equal(u[2, :5], torch.rand(5, generator=third))
    assert (u[0, 3:] == 0.5).all() and (u[1] == 0.5).all() and (u[2, 5:] == 0.5).all()
    assert torch.equal(uniforms(seqs[0], 1), torch.rand(1, generator=first))
    assert torch.equal(uniforms(seqs[2], 1), torch.rand(1, generator=third))


def test_a_chains_greedy_accept_is_the_tree_walks() -> None:
    """Chains take a fast path (their leading matches); it accepts what walking the tree's
    children does, whatever the matches, the length and a padded argmax row."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 8, (1,), generator=gen))
        tree = chain(torch.randint(0, 4, (n,), generator=gen).tolist())
        pad = int(torch.randint(0, 3, (1,), generator=gen))
        argmax = torch.randint(0, 4, (n + 1 + pad,), generator=gen)
        assert accept_greedy_argmax(tree, argmax.tolist()) == greedy_path(tree, argmax.tolist())
