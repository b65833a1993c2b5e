"""Which exact rule accepts most of a sampled draft, per tree level: the target's and the
draft's warped distributions p and q at the same positions, and what each rule accepts there.

    python -m bench.cpu accept-rules [--prompts 8] [--positions 24] [--draws 64]

At each position of the target's own sampled continuation (held-out code, prose) of the
shipped target, with the shipped draft LM's q at the same prefix:
- **rejection with q** (one draft x ~ q, accepted with min(1, p(x)/q(x))): Σ min(p, q), what a
  sampled chain accepts today;
- **target-only, top k** (the draft's k likeliest as candidates, no q: SGLang's rule, what a
  sampled tree uses today): accepted with p's mass on them, Σ_{x in top k of q} p(x);
- **recursive rejection, k drawn without replacement** (`rrs_level`): k candidates drawn from q
  without replacement, each tried against the residual of the last (Jeon et al. 2024,
  "Recursive Speculative Decoding"), estimated over `--draws` draws a position.

A level's acceptance is the chance that one of its candidates is taken; a tree's accept length
compounds it over its depth. Writes JSON (default bench/out/accept_rules.json).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import device_info, format_table, write_json
from bench.prompts import code_prompts, prose_prompts
from specpair.runtime.sampling import SamplingParams, warp

KS = (1, 2, 4)


def rrs_level(p: Tensor, q: Tensor, k: int, generator: torch.Generator) -> tuple[int, int]:
    """One level of recursive rejection over k drafts drawn from q without replacement: (the
    index of the accepted draft or -1, the token emitted); `level` over `drawn`. The emitted
    token is distributed as p (tests/unit)."""
    return level(p, *drawn(q, k, generator), generator)


def level(
    p: Tensor, candidates: Sequence[int], qs: Sequence[Tensor], g: torch.Generator
) -> tuple[int, int]:
    """One level of recursive rejection over `candidates`, candidate j drawn from qs[j]: (the
    index of the one taken or -1, the token emitted). Taken with min(1, p_j(x) / q_j(x)); a
    rejection moves p to norm(max(p_j − q_j, 0)); none taken: the token is drawn from the last
    residual. qs[j] one-hot at x_j is the target-only rule (taken with p_j(x), x then removed)."""
    pj = p.double()
    for j, (x, qj) in enumerate(zip(candidates, qs, strict=True)):
        if float(torch.rand((), generator=g, dtype=torch.float64)) * float(qj[x]) < float(pj[x]):
            return j, x
        residual = torch.clamp(pj - qj, min=0.0)
        if residual.sum() <= 0:  # p == q_j: rejection had probability 0
            break
        pj = residual / residual.sum()
    return -1, int(torch.multinomial(pj, 1, generator=g))


def drawn(q: Tensor, k: int, g: torch.Generator) -> tuple[list[int], list[Tensor]]:
    """k tokens drawn from q without replacement, and the distribution each was drawn from
    (q less the ones before it, renormalised); fewer where q has fewer than k tokens."""
    tokens, qs, qj = [], [], q.double()
    for _ in range(min(k, int((q > 0).sum()))):
        qj = qj / qj.sum()
        x = int(torch.multinomial(qj, 1, generator=g))
        tokens.append(x)
        qs.append(qj)
        qj = qj.clone()
        qj[x] = 0.0
    return tokens, qs


def recursive_rate(p: Tensor, q: Tensor, k: int, draws: int, g: torch.Generator) -> float:
    """The share of `draws` levels of `rrs_level` that accept one of their k drafts."""
    return sum(rrs_level(p, q, k, g)[0] >= 0 for _ in range(draws)) / draws


def positions(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    ids: list[int],
    n: int,
    sampling: SamplingParams,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """(p, q) [n, V]: the target's and the draft's warped distributions at each of the n
    positions of the target's own sampled continuation of `ids`."""
    tokens = torch.tensor([ids])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(n):
            p = warp(target(tokens).logits[0, -1], sampling)
            tokens = torch.cat([tokens, torch.multinomial(p, 1, generator=g)[None]], 1)
        p = warp(target(tokens).logits[0, -n - 1 : -1], sampling)
        q = warp(draft(tokens).logits[0, -n - 1 : -1], sampling)
    return p, q


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu accept-rules",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--positions", type=int, default=24, help="sampled positions a prompt")
    parser.add_argument("--draws", type=int, default=64, help="draws a position (recursive)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/accept_rules.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.models / "target")
    load = AutoModelForCausalLM.from_pretrained
    target = load(args.models / "target", dtype=torch.float32).eval()
    draft = load(args.models / "draft", dtype=torch.float32).eval()
    sets = {"code": code_prompts(tok, args.prompts, 96, 128), "prose": prose_prompts(tok)}
    rows: list[list[str]] = []
    cells: list[dict[str, object]] = []
    g = torch.Generator().manual_seed(1)
    for name, prompts in sets.items():
        for t, top_p in ((0.7, 0.95), (1.0, 1.0)):
            sampling = SamplingParams(temperature=t, top_p=top_p)
            rs: list[float] = []
            only: dict[int, list[float]] = {k: [] for k in KS}
            rrs: dict[int, list[float]] = {k: [] for k in KS}
            for i, prompt in enumerate(prompts):
                p, q = positions(target, draft, prompt.ids, args.positions, sampling, seed=i)
                rs += torch.minimum(p, q).sum(-1).tolist()
                for k in KS:
                    only[k] += p.gather(-1, q.topk(k, -1).indices).sum(-1).tolist()
                    rrs[k] += [recursive_rate(p[r], q[r], k, args.draws, g) for r in range(len(p))]
            n = len(rs)
            rejection = sum(rs) / n
            target_only = {k: sum(v) / n for k, v in only.items()}
            recursive = {k: sum(v) / n for k, v in rrs.items()}
            cells.append(
                {
                    "prompts": name,
                    "temperature": t,
                    "top_p": top_p,
                    "positions": n,
                    "rejection": rejection,
                    "target_only": target_only,
                    "recursive": recursive,
                }
            )
            rows.append(
                [
                    name,
                    f"{t:g}",
                    f"{top_p:g}",
                    f"{rejection:.3f}",
                    *(f"{target_only[k]:.3f}" for k in KS),
                    *(f"{recursive[k]:.3f}" for k in KS),
                    str(n),
                ]
            )
            print(f"  {name} T={t:g}: {n} positions", flush=True)
    write_json(args.out, {"device": device_info(), "draws": args.draws, "cells": cells})
    heads = [
        "prompts",
        "T",
        "top-p",
        "rejection (k 1)",
        *(f"target-only k {k}" for k in KS),
        *(f"recursive k {k}" for k in KS),
        "positions",
    ]
    print(format_table(heads, rows))
