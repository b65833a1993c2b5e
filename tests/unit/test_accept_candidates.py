"""The sampled accept over each row's candidates is the vocabulary-wide rule.

`accept_candidates` must give the exact one-draft outcome distribution (drafts on and off the
candidates, q sparse; a broken residual fails the same test), the same verdicts as
`accept_chains` over the vocabulary for the same uniforms, the argmax rule on greedy rows,
and say which requests it cannot cover (their cut lies past the candidates). The trees' form,
`accept_tree_candidates`, must give `accept_trees`' verdicts over the vocabulary and sample
the root's p by elimination (accepting every first child fails that).
"""

from __future__ import annotations

import pytest
import torch

import specpair.runtime.accept as accept_module
import specpair.runtime.sampling as sampling_module
from specpair.runtime.accept import accept_chains, accept_greedy_argmax
from specpair.runtime.accept_batch import (
    ChainBatch,
    accept_candidates,
    accept_chain_batch,
    accept_tree_candidates,
    sparse_q,
)
from specpair.runtime.sampling import RowParams, SamplingParams, warp, warp_rows
from specpair.runtime.tree import chain
from tests.unit.test_sampling_rows import fits, one_draft_outcomes

V, CANDIDATES = 300, 32
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)


@pytest.fixture(autouse=True)
def few_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_module, "CANDIDATES", CANDIDATES)


def peaked(rows: int, seed: int) -> torch.Tensor:
    """Logits whose top-p 0.9 cut at T = 0.7 falls among the first ~10 tokens."""
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))
    logits[:, :10] += 6
    return logits


def one_draft_counts(n_runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(observed [2, V] counts of (accepted, last token), their exact distribution) of a
    one-draft chain whose sparse q puts mass on and off the target's candidates."""
    gen = torch.Generator().manual_seed(5)
    logits = peaked(2, seed=4)
    q_ids = torch.tensor([0, 1, 2, 3, 50, 120, 200, 299])  # 4 among the candidates, 4 off
    q = torch.softmax(torch.randn(8, generator=gen), -1)
    x = q_ids[torch.multinomial(q, n_runs, replacement=True, generator=gen)]
    params = RowParams.of([SAMPLED] * 2 * n_runs)
    accepted, last, covered = accept_candidates(
        logits.expand(n_runs, -1, -1),
        params,
        x[:, None],
        torch.ones(n_runs).long(),
        torch.rand(n_runs, 2, generator=gen),
        q_ids.expand(n_runs, 1, -1),
        q.expand(n_runs, 1, -1),
    )
    assert covered.all()
    observed = torch.zeros(2, V)
    for a in (0, 1):
        observed[a] = torch.bincount(last[accepted == a], minlength=V)
    p = warp(logits, SAMPLED)
    return observed, one_draft_outcomes(p[0], p[1], torch.zeros(V).scatter_(0, q_ids, q))


def test_accept_candidates_matches_the_exact_one_draft_outcome_distribution() -> None:
    observed, exact = one_draft_counts(20000)
    assert fits(observed, exact)


def test_a_broken_residual_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the last token from p after a rejection, not norm((p − q)+)."""
    monkeypatch.setattr(accept_module, "residual", lambda p, q: p)
    observed, exact = one_draft_counts(20000)
    assert not fits(observed, exact)


def test_verdicts_equal_accept_chains_over_the_vocabulary() -> None:
    """Same uniforms, same accepted counts (p(x) and q(x) are the same floats); the last
    token lies where its distribution has mass. Greedy and filtered requests mixed."""
    b, n = 6, 3
    gen = torch.Generator().manual_seed(9)
    logits = peaked(b * (n + 1), seed=8).view(b, n + 1, V)
    requests = [
        SAMPLED,
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.5, min_p=0.1),
        SAMPLED,
        SamplingParams(top_p=0.5),
    ]
    params = RowParams.of(requests).repeat(n + 1)
    drafts = torch.randint(0, 12, (b, n), generator=gen)
    drafts[0] = logits[0, :n].argmax(-1)  # likely accepted throughout
    q_ids = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in range(b * n)])
    q_ids = q_ids.view(b, n, 8)
    q_ids[..., 0] = drafts
    q = torch.softmax(torch.randn(b, n, 8, generator=gen), -1)
    lengths = torch.tensor([3, 3, 2, 3, 1, 3])
    u = torch.rand(b, n + 1, generator=gen)
    accepted, last, covered = accept_candidates(logits, params, drafts, lengths, u, q_ids, q)
    assert covered.all()
    p = warp_rows(logits.view(-1, V), params).view(b, n + 1, V)
    dense_q = torch.zeros(b, n, V).scatter_add_(-1, q_ids, q)
    ref_accepted, _ = accept_chains(p, dense_q, drafts, lengths, u)
    assert accepted.tolist() == ref_accepted.tolist()
    for i, (m, token) in enumerate(zip(accepted.tolist(), last.tolist(), strict=True)):
        assert p[i, m, token] > 0
        if requests[i].greedy:
            ref = accept_greedy_argmax(chain(drafts[i].tolist()), logits[i].argmax(-1).tolist())
            assert (m, token) == (min(ref.accept_length, 3), ref.bonus)


def test_greedy_rows_take_the_first_argmax_among_ties() -> None:
    logits = torch.zeros(1, 2, V)
    logits[0, :, [7, 3]] = 5.0  # tied: the argmax is 3
    q_ids = torch.tensor([[[3]]])
    accepted, last, _ = accept_candidates(
        logits,
        RowParams.of([SamplingParams()] * 2),
        torch.tensor([[3]]),
        torch.tensor([1]),
        torch.full((1, 2), 0.5),
        q_ids,
        torch.ones(1, 1, 1),
    )
    assert (int(accepted[0]), int(last[0])) == (1, 3)


def test_a_cut_past_the_candidates_is_not_covered_and_the_batch_accepts_all_the_same() -> None:
    """T = 2, top-p 0.99 over 300 near-flat tokens keeps more than 32: that request is not
    covered, and `accept_chain_batch` falls back to the warp over the vocabulary."""
    logits = peaked(4, seed=2).view(2, 2, V)
    logits[1] = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 0.1
    requests = [SAMPLED, SamplingParams(temperature=2.0, top_p=0.99)]
    params = RowParams.of(requests).repeat(2)
    drafts = torch.tensor([[1], [2]])
    q_ids, q = drafts[..., None], torch.ones(2, 1, 1)
    u = torch.full((2, 2), 0.3)
    lengths = torch.tensor([1, 1])
    _, _, covered = accept_candidates(logits, params, drafts, lengths, u, q_ids, q)
    assert covered.tolist() == [True, False]
    batch = ChainBatch(params, drafts, lengths, u, q_ids, q)
    verdicts = accept_chain_batch(logits, batch)
    p = warp_rows(logits.view(-1, V), params).view(2, 2, V)
    for i, (m, token) in enumerate(verdicts):
        assert p[i, m, token] > 0


# root → 1, 2, 3; 1 → 4, 5; 4 → 6: children after their parent, as drafted
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 4]


def tree_case(b: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Peaked logits [b, 7, V] over TREE_PARENTS' trees whose tokens are likely ones (each a
    row's top 12, so some are kept and some cut; node 1 the root's second likeliest) or, at
    node 3, one off the candidates."""
    gen = torch.Generator().manual_seed(seed)
    logits = peaked(b * 7, seed=seed).view(b, 7, V)
    parents = torch.tensor(TREE_PARENTS).expand(b, 7).clone()
    tokens = torch.randint(0, 12, (b, 7), generator=gen)
    tokens[:, 1] = logits[:, 0].topk(2).indices[:, 1]  # the root's second likeliest: has mass
    tokens[:, 3] = 250
    return logits, tokens, parents


def test_tree_verdicts_equal_accept_trees_over_the_vocabulary() -> None:
    b = 8
    logits, tokens, parents = tree_case(b, seed=12)
    requests = [SAMPLED, SamplingParams(), SamplingParams(temperature=1.0, top_k=5), SAMPLED] * 2
    params = RowParams.of(requests).repeat(7)
    u = torch.rand(b, 7, generator=torch.Generator().manual_seed(13))
    accepted, last, covered = accept_tree_candidates(logits, params, tokens, parents, u)
    assert covered.all() and accepted.any()
    p = warp_rows(logits.view(-1, V), params).view(b, 7, V)
    ref_accepted, _ = accept_module.accept_trees(p, tokens, parents, u)
    assert torch.equal(accepted, ref_accepted)
    deepest = (accepted * torch.arange(7)).amax(-1)
    assert (p[torch.arange(b), deepest, last] > 0).all()


def first_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [V] of the first token out, accepted child or last, p of the root) over n
    draws of one tree: SGLang's rule samples the root's p by elimination."""
    logits, tokens, parents = tree_case(1, seed=14)
    params = RowParams.of([SAMPLED] * n).repeat(7)
    u = torch.rand(n, 7, generator=torch.Generator().manual_seed(15))
    tokens, parents = tokens.expand(n, 7), parents.expand(n, 7)
    accepted, last, _ = accept_tree_candidates(logits.expand(n, -1, -1), params, tokens, parents, u)
    child = accepted[:, 1:4]  # the root's children
    first = torch.where(
        child.any(-1), tokens[:, 1:4].gather(1, child.long().argmax(-1, True))[:, 0], last
    )
    return torch.bincount(first, minlength=V), warp(logits[0, 0], SAMPLED)


def test_accept_tree_candidates_samples_the_roots_p() -> None:
    counts, p = first_tokens(20000)
    assert fits(counts, p)


def test_trees_accepting_every_first_child_fail_the_same_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = accept_module.accept_trees

    def first_child(p, tokens, parents, u):  # type: ignore[no-untyped-def]
        return real(p, tokens, parents, torch.cat([u[:, :1], torch.zeros_like(u[:, 1:])], 1))

    monkeypatch.setattr(accept_module, "accept_trees", first_child)
    counts, p = first_tokens(20000)
    assert not fits(counts, p)


class Seq:
    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling, self.generator = sampling, torch.Generator().manual_seed(0)


@pytest.mark.parametrize("tree_round", [False, True])
def test_accept_batch_says_where_the_accept_ran(tree_round: bool) -> None:
    """greedy: the argmax; a graph's verdicts taken as they come; none: batched on the
    logits' device; the batch-invariant mode: the host, request by request."""
    from specpair.runtime.target.accepting import accept_batch
    from specpair.runtime.tree import CandidateTree, chain

    seqs = [Seq(SAMPLED), Seq(SamplingParams())]
    tree = CandidateTree((1, 2), (-1, -1)) if tree_round else chain([1, 2])
    trees = [tree, tree]
    logits = peaked(6, seed=20).view(2, 3, V)
    greedy = [Seq(SamplingParams()), Seq(SamplingParams())]
    assert accept_batch(greedy, trees, logits, 3, lambda b: None)[1] == "greedy"
    accs, path = accept_batch(seqs, trees, logits, 3, lambda b: None)
    assert path == "device" and len(accs) == 2
    # a graph's verdicts: chains [accepted drafts, last token], trees [last token, nodes…]
    canned = [[0, 1], [0, 1]] if tree_round else [[1, 7], [1, 7]]
    accs, path = accept_batch(seqs, trees, logits, 3, lambda b: canned)
    expected = ((0,), 0) if tree_round else ((0,), 7)
    assert path == "graph" and [(a.nodes, a.bonus) for a in accs] == [expected] * 2
    assert accept_batch(seqs, trees, logits, 3, lambda b: None, per_request=True)[1] == "host"


def test_sparse_q_places_each_requests_q_in_its_rows() -> None:
    """The batch's sparse q: each sampled request's own q in its first rows, a greedy or
    q-less request one-hot at its drafts, a dense q only listed; full chains, short ones,
    narrower q, int32 and int64 ids, half-precision q mixed in one batch."""
    gen = torch.Generator().manual_seed(3)
    n, width, vocab = 4, 6, 50
    for _ in range(50):
        trees, greedy = [], []
        for _ in range(int(torch.randint(1, 9, (1,), generator=gen))):
            m = int(torch.randint(0, n + 1, (1,), generator=gen))
            k = width if torch.rand(1, generator=gen) < 0.7 else 3
            q_ids = (
                torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(m)])
                if m
                else torch.zeros(0, k, dtype=torch.long)
            )
            q = torch.softmax(torch.randn(m, k, generator=gen), -1)
            kind = int(torch.randint(0, 5, (1,), generator=gen))
            tokens = q_ids[:, 0].tolist()
            if kind == 0:
                trees.append(chain(tokens))  # no q
            elif kind == 1:
                trees.append(chain(tokens, torch.softmax(torch.randn(m, vocab), -1)))  # dense
            else:
                trees.append(
                    chain(tokens, q.half() if kind == 2 else q, q_ids.int() if kind == 3 else q_ids)
                )
            greedy.append(bool(torch.rand(1, generator=gen) < 0.2))
        drafts = torch.zeros(len(trees), n, dtype=torch.long)
        for i, tree in enumerate(trees):
            drafts[i, : len(tree)] = torch.tensor(tree.tokens, dtype=torch.long)
        ids, probs, dense = sparse_q(greedy, trees, drafts)
        assert ids.shape[:2] == probs.shape[:2] == (len(trees), n)
        listed = {i for i, _ in dense}
        for i, (tree, g) in enumerate(zip(trees, greedy, strict=True)):
            m = len(tree)
            own = not g and m and tree.draft_probs is not None
            if own and tree.draft_ids is not None:
                k = tree.draft_ids.shape[1]
                assert torch.equal(ids[i, :m, :k], tree.draft_ids.long())
                assert torch.equal(probs[i, :m, :k], tree.draft_probs.float())
                assert not probs[i, :m, k:].any()
                assert i not in listed
            elif own:  # dense: no sparse mass here, the q listed
                assert i in listed and not probs[i, :m].any()
            else:  # one-hot at the drafts
                assert i not in listed
                assert torch.equal(ids[i, :, 0], drafts[i]) and (probs[i, :, 0] == 1).all()
                assert not probs[i, :, 1:].any()
            assert torch.equal(ids[i, m:, 0], drafts[i, m:]) and (probs[i, m:, 0] == 1).all()
