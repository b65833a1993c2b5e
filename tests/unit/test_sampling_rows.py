"""The batched sampling on the device agrees with the per-request host reference.

`warp_rows` must give `warp`'s distribution row by row for every warp, `sample_rows` must draw
from the row it is given (and never a token without mass), `draft_support` must return the
exact q its token was drawn from, and `accept_chains` must give `accept_sampling`'s outcome
distribution (computed exactly here for a one-draft chain) with greedy rows reduced to the
argmax rule.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from scipy.stats import chisquare

import specpair.runtime.sampling as sampling_module
from specpair.models.tiny import make_tiny_eagle, make_tiny_eagle3, make_tiny_llama
from specpair.runtime.accept import accept_chains, accept_greedy_argmax, residual
from specpair.runtime.build import build_drafter
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    draft_support,
    sample_rows,
    warp,
    warp_rows,
)
from specpair.runtime.tree import chain

WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=1),
]


def fits(observed: torch.Tensor, probs: torch.Tensor) -> bool:
    """Chi-square of counts against probabilities (cells expecting < 5 draws pooled away)."""
    obs, exp = observed.double().flatten(), probs.double().flatten()
    keep = exp * obs.sum() >= 5
    obs, exp = obs[keep], exp[keep]
    return bool(chisquare(obs.tolist(), (exp / exp.sum() * obs.sum()).tolist()).pvalue > 1e-3)


def logits_of(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_warp_rows_equals_the_reference_warp_row_by_row() -> None:
    logits = logits_of(len(WARPS), 200)
    batched = warp_rows(logits, RowParams.of(WARPS))
    for i, params in enumerate(WARPS):
        torch.testing.assert_close(batched[i], warp(logits[i], params), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("candidates", [16, 64])
def test_warp_rows_from_few_candidates_or_by_the_fallback_sort_equals_the_reference(
    candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose cut falls among the candidates (sharp, top-k, min-p) and a batch where one
    row's does not (T = 2 over 300 tokens, top-p 0.99: the whole batch sorts) agree alike."""
    monkeypatch.setattr(sampling_module, "CANDIDATES", candidates)
    sharp = [
        SamplingParams(temperature=0.3, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=8),
        SamplingParams(temperature=0.5, min_p=0.2),
    ]
    for rows in (sharp, [*sharp, SamplingParams(temperature=2.0, top_p=0.99)]):
        logits = logits_of(len(rows), 300, seed=len(rows))
        batched = warp_rows(logits, RowParams.of(rows))
        for i, params in enumerate(rows):
            torch.testing.assert_close(batched[i], warp(logits[i], params), atol=1e-6, rtol=1e-5)


def test_warp_rows_keeps_ties_at_the_kth_logit_as_the_reference() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    batched = warp_rows(logits, RowParams.of([params]))[0]
    assert (batched > 0).tolist() == [True, True, True, True, False]
    torch.testing.assert_close(batched, warp(logits[0], params))


def test_greedy_rows_are_one_hot_at_the_first_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    probs = warp_rows(logits, RowParams.of([SamplingParams(), SamplingParams(temperature=1.0)]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert 0 < probs[1, 1] < 0.01


def test_rows_without_filters_skip_the_sort_and_still_match() -> None:
    params = RowParams.of([SamplingParams(temperature=0.8)])
    assert not params.filters
    logits = logits_of(1, 50, seed=3)
    torch.testing.assert_close(
        warp_rows(logits, params)[0], warp(logits[0], SamplingParams(temperature=0.8))
    )


def test_sample_rows_draws_from_its_row() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    tokens = sample_rows(probs.expand(len(u), -1).contiguous(), u)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[1] == 0
    assert fits(counts, probs)


def test_sample_rows_never_picks_a_token_without_mass_at_the_top_of_the_range() -> None:
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    for u in (0.0, 0.9999999, 1.0 - 2**-24):
        token = int(sample_rows(probs, torch.tensor([u]))[0])
        assert probs[0, token] > 0


def test_draft_support_returns_the_q_its_tokens_are_drawn_from() -> None:
    logits = logits_of(1, 100, seed=5).expand(30000, -1).contiguous()
    params = RowParams.of([SamplingParams(temperature=0.8, top_p=0.9)] * len(logits))
    u = torch.rand(len(logits), generator=torch.Generator().manual_seed(2))
    tokens, ids, q = draft_support(logits, params, u, width=8)
    assert ids.shape == q.shape == (len(logits), 8)
    torch.testing.assert_close(q.sum(-1), torch.ones(len(logits)))
    dense = torch.zeros(100).scatter_(0, ids[0], q[0])
    counts = torch.bincount(tokens, minlength=100)
    kept = dense > 0
    assert counts[~kept].sum() == 0
    assert fits(counts, dense)


def test_draft_support_respects_top_k_and_greedy_rows() -> None:
    logits = logits_of(2, 50, seed=6)
    params = RowParams.of([SamplingParams(temperature=1.0, top_k=3), SamplingParams()])
    tokens, _, q = draft_support(logits, params, torch.tensor([0.99, 0.5]), width=10)
    assert (q[0, 3:] == 0).all() and (q[0, :3] > 0).all()
    assert int(tokens[1]) == int(logits[1].argmax())


@pytest.mark.parametrize("kind", ["eagle3", "eagle-map"])
def test_a_head_samples_over_its_draft_vocabulary_as_over_the_target_vocabulary(
    kind, tmp_path
) -> None:
    """`draft_support` over the ids a head names (`named_logits`: no topk over the whole
    vocabulary) draws the token and q that it does over the head's target-wide logits, from
    the same uniforms."""
    target = make_tiny_llama(tmp_path / "target", seed=1, vocab_size=300, tokenizer=False)
    if kind == "eagle3":
        draft = make_tiny_eagle3(
            tmp_path / "head", target, seed=2, draft_vocab=80, layers=[0, 0, 0]
        )
        token_map = None
    else:
        draft = make_tiny_eagle(tmp_path / "head", target, seed=2)
        token_map = tmp_path / "map.json"
        token_map.write_text(json.dumps(sorted(random.Random(3).sample(range(300), 80))))
    drafter = build_drafter(
        draft, target_path=target, max_requests=4, max_len=16, token_map=token_map
    )
    head = drafter.head  # type: ignore[attr-defined]
    hidden = torch.randn(6, 1, head.args.hidden_size, generator=torch.Generator().manual_seed(4))
    params = RowParams.of(
        [
            SamplingParams(temperature=0.7, top_p=0.95),
            SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(),
            SamplingParams(temperature=1.3, min_p=0.1),
            SamplingParams(1.0),
            SamplingParams(1.0),
        ]
    )
    u = torch.rand(6, generator=torch.Generator().manual_seed(5))
    logits, names = drafter.named_logits(hidden)
    tokens, ids, q = draft_support(logits, params, u, names=names)
    ref_tokens, ref_ids, ref_q = draft_support(drafter.logits(hidden), params, u)
    assert tokens.tolist() == ref_tokens.tolist()
    dense = torch.zeros(6, 300).scatter_add_(-1, ids, q)
    torch.testing.assert_close(dense, torch.zeros(6, 300).scatter_add_(-1, ref_ids, ref_q))
    assert names is not None and len(names) == 80
    assert set(ids[q > 0].tolist()) <= set(names.tolist())


def one_draft_outcomes(p0: torch.Tensor, p1: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of (accepted, last token) of a one-draft chain drawn from q: [2, V]."""
    accept = torch.minimum(torch.ones_like(p0), p0 / q.clamp_min(1e-30))
    out = torch.zeros(2, len(p0))
    out[1] = (q * accept).sum() * p1  # accepted: the bonus from p1 (x is fixed per draw)
    reject = (q * (1 - accept)).sum()
    out[0] = reject * residual(p0[None], q[None])[0]
    return out


def test_accept_chains_matches_the_exact_one_draft_outcome_distribution() -> None:
    """A draft token x ~ q, then `accept_chains`: (accepted, token) must follow
    P(accept x) = q(x) min(1, p0(x)/q(x)) with the bonus from p1, else the residual."""
    v, n_runs = 5, 40000
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, v, generator=gen), -1)
    q = torch.softmax(torch.randn(v, generator=gen), -1)
    x = torch.multinomial(q, n_runs, replacement=True, generator=gen)
    u = torch.rand(n_runs, 2, generator=gen)
    accepted, last = accept_chains(
        p.expand(n_runs, -1, -1), q.expand(n_runs, 1, -1), x[:, None], torch.ones(n_runs).long(), u
    )
    observed = torch.zeros(2, v)
    for a in (0, 1):
        observed[a] = torch.bincount(last[accepted == a], minlength=v)
    assert fits(observed, one_draft_outcomes(p[0], p[1], q))
    # the marginal of the first token is p0 itself: the point of the rule
    first = torch.where(accepted == 1, x, last)
    assert fits(torch.bincount(first, minlength=v), p[0])


def test_accept_chains_on_one_hot_rows_is_the_greedy_rule() -> None:
    """Greedy rows of a mixed batch: p one-hot at the target's argmax, q one-hot at the drafts."""
    v = 10
    argmax = [[4, 5, 9, 1], [4, 5, 6, 7]]  # row 0 rejects its third draft, row 1 takes all
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6]])
    p = torch.zeros(2, 4, v).scatter_(-1, torch.tensor(argmax)[..., None], 1.0)
    q = torch.zeros(2, 3, v).scatter_(-1, drafts[..., None], 1.0)
    u = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    accepted, last = accept_chains(p, q, drafts, torch.tensor([3, 3]), u)
    for row in range(2):
        ref = accept_greedy_argmax(chain(drafts[row].tolist()), argmax[row])
        assert (int(accepted[row]), int(last[row])) == (ref.accept_length, ref.bonus)


def test_accept_chains_with_shorter_chains_in_the_batch() -> None:
    """Padding past a chain's length is never accepted; its last token comes after it."""
    p = torch.full((2, 3, 4), 0.25)
    q = torch.full((2, 2, 4), 0.25)
    drafts = torch.tensor([[1, 2], [3, 0]])
    u = torch.zeros(2, 3)  # accept whatever may be accepted
    accepted, _ = accept_chains(p, q, drafts, torch.tensor([2, 1]), u)
    assert accepted.tolist() == [2, 1]


@pytest.mark.parametrize("vocab", [7, 1000])
def test_plain_rounds_are_accept_chains_without_drafts(vocab: int) -> None:
    p = torch.softmax(logits_of(3, vocab), -1)
    u = torch.tensor([[0.1], [0.5], [0.9]])
    accepted, last = accept_chains(
        p[:, None], torch.zeros(3, 0, vocab), torch.zeros(3, 0).long(), torch.zeros(3).long(), u
    )
    assert accepted.tolist() == [0, 0, 0]
    assert last.tolist() == sample_rows(p, u[:, 0]).tolist()


def test_a_rows_probabilities_do_not_depend_on_the_rows_beside_it(monkeypatch) -> None:
    """Each row takes its own way (softmax, candidates, or the sort its cut needs), so a row's
    warp is the same bits alone and in any batch: seeded draws stay batch-independent."""
    monkeypatch.setattr(sampling_module, "CANDIDATES", 16)
    params = [
        SamplingParams(temperature=0.3, top_p=0.9),  # cut among the candidates
        SamplingParams(temperature=1.3),  # no filter: a softmax
        SamplingParams(temperature=2.0, top_p=0.99),  # cut past them: sorts
        SamplingParams(),  # greedy
        SamplingParams(top_p=0.99),  # greedy: its filter changes nothing
    ]
    logits = logits_of(len(params), 300, seed=11)
    together = warp_rows(logits, RowParams.of(params))
    for i, p in enumerate(params):
        assert torch.equal(warp_rows(logits[i : i + 1], RowParams.of([p]))[0], together[i])
    assert together[4].max() == 1.0 and int(together[4].argmax()) == int(logits[4].argmax())


def test_sample_rows_over_a_large_vocabulary_draws_in_two_levels_exactly() -> None:
    """Past 2 × DRAW_SLICE tokens: a slice, then a token within it; mass spread over slices,
    with zero-mass slices between, and u at the top of the range never lands on no mass."""
    v = 3 * sampling_module.DRAW_SLICE + 17  # a partial last slice
    probs = torch.zeros(v)
    where = torch.tensor([3, 1500, 1501, 2100, v - 1])
    probs[where] = torch.tensor([0.1, 0.25, 0.05, 0.4, 0.2])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(3))
    tokens = sample_rows(probs.expand(len(u), -1).contiguous(), u)
    assert torch.isin(tokens, where).all()
    assert fits(torch.bincount(tokens, minlength=v), probs)
    edge = sample_rows(probs[None], torch.tensor([1.0 - 2**-24]))
    assert probs[edge] > 0
