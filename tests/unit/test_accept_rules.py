"""The recursive rejection rule `bench.cpu.accept_rules` measures (k drafts drawn from q without
replacement, each tried against the last residual) emits tokens distributed as p, whatever q
and k; a variant that leaves p unchanged after a rejection does not (the test's power)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from bench.cpu.accept_rules import drawn, level, rrs_level
from bench.cpu.tree_rrs import likeliest, parse_template
from specpair.runtime.accept import accept_sampling
from specpair.runtime.tree import CandidateTree

N = 12_000


def emitted(p: torch.Tensor, q: torch.Tensor, k: int, level=rrs_level) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    counts = torch.zeros(p.numel(), dtype=torch.float64)
    for _ in range(N):
        counts[level(p, q, k, g)[1]] += 1
    return counts


def fits(counts: torch.Tensor, p: torch.Tensor) -> bool:
    keep = p > 0
    assert counts[~keep].sum() == 0  # never a token p excludes
    mass = p[keep].double()
    expected = (mass / mass.sum() * float(counts.sum())).tolist()
    return bool(chisquare(counts[keep].tolist(), expected).pvalue > 1e-3)


def cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, 0)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, 0)
    p_cut = p.clone()
    p_cut[[1, 5]] = 0.0  # top-p left two tokens out of p: q still proposes them
    return [(p, q), (p_cut / p_cut.sum(), q), (p, torch.full((8,), 1 / 8))]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("case", range(3))
def test_recursive_rejection_emits_p(case: int, k: int) -> None:
    p, q = cases()[case]
    assert fits(emitted(p, q, k), p)


def no_residual(p: torch.Tensor, q: torch.Tensor, k: int, g: torch.Generator) -> tuple[int, int]:
    """The rule with p kept after a rejection (no residual): biased toward q's tokens."""
    pj, qj = p.double(), q.double()
    for j in range(k):
        qj = qj / qj.sum()
        x = int(torch.multinomial(qj, 1, generator=g))
        if float(torch.rand((), generator=g, dtype=torch.float64)) * qj[x] < pj[x]:
            return j, x
        qj = qj.clone()
        qj[x] = 0.0
    return -1, int(torch.multinomial(pj, 1, generator=g))


def test_without_the_residual_the_same_test_fails() -> None:
    p, q = cases()[0]
    assert not fits(emitted(p, q, 4, no_residual), p)


def test_more_drafts_accept_more() -> None:
    p, q = cases()[0]
    g = torch.Generator().manual_seed(3)
    rates = [sum(rrs_level(p, q, k, g)[0] >= 0 for _ in range(4000)) / 4000 for k in (1, 2, 4)]
    assert rates[0] == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.03)
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.parametrize("k", [1, 4])
def test_the_target_only_rule_over_the_likeliest_emits_p(k: int) -> None:
    """`level` with one-hot q over the draft's k likeliest: SGLang's target-only rule."""
    p, q = cases()[0]
    assert fits(emitted(p, q, k, lambda p, q, k, g: level(p, *likeliest(q, k), g)), p)


def iid_q(p: torch.Tensor, q: torch.Tensor, k: int, g: torch.Generator) -> tuple[int, int]:
    """Drafts drawn without replacement but each tried against q itself, as if drawn
    independently (what a SpecInfer-style verifier of i.i.d. siblings assumes)."""
    tokens, _ = drawn(q, k, g)
    return level(p, tokens, [q.double()] * len(tokens), g)


def test_drafts_drawn_without_replacement_need_their_own_q() -> None:
    """Tried against the q they were not drawn from, the same drafts emit a biased token: the
    tree-rrs bench's rule must carry each candidate's q less its earlier siblings."""
    p, q = cases()[0]
    assert not fits(emitted(p, q, 4, iid_q), p)


def host_verifier(own_q: bool) -> Any:
    """A level as `accept_sampling` verifies it: siblings drawn without replacement, each sent
    with q less the siblings before it (`own_q`), or each with the parent's q itself."""

    def verify(p: torch.Tensor, q: torch.Tensor, k: int, g: torch.Generator) -> tuple[int, int]:
        tokens, qs = drawn(q, k, g)
        sent = torch.stack(qs if own_q else [q.double()] * len(tokens)).float()
        tree = CandidateTree(tuple(tokens), (-1,) * len(tokens), sent)
        acc = accept_sampling(tree, p.expand(len(tokens) + 1, -1), g)
        return (acc.nodes[0], acc.tokens[0]) if acc.tokens else (-1, acc.bonus)

    return verify


@pytest.mark.parametrize("own_q", [True, False])
def test_siblings_drawn_without_replacement_are_exact_with_each_ones_own_q(own_q: bool) -> None:
    """`accept_sampling` tries each child against the q the wire gives it: three siblings each
    sent with q less the siblings before it emit p; each sent the parent's q, a biased token
    (the control)."""
    p, q = cases()[0]
    assert fits(emitted(p, q, 3, host_verifier(own_q)), p) == own_q


def test_tree_templates_parse_or_name_what_is_wrong() -> None:
    assert parse_template("2x3") == (2, 2, 2)
    assert parse_template("4,2,1") == (4, 2, 1)
    for bad in ("0x7", "4,0", "x", "four"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_template(bad)
