"""What a sampled tree would accept verified by recursive rejection, end to end on the shipped
pair: the design the per-level `accept-rules` points to, measured over whole rounds before it is
built into the services.

    python -m bench.cpu tree-rrs [--prompts 8] [--new-tokens 48] [--templates 1x7 2x7 4,4,2,2,1,1,1]

A round drafts a *spine* tree: k_d candidates at depth d, all children of the spine node above
them, the spine continuing from the first of them (`4,2,1` is 4 + 2 + 1 = 7 nodes, 3 deep). The
target walks it level by level (`level`), and the round ends at the first level where it takes
no spine node: after a side candidate (a leaf) or none, with the token that level emits.

- **recursive**: the candidates drawn from the draft's q without replacement, each tried
  against the residual of the last (exact; `bench.cpu.accept_rules.rrs_level`'s rule). Its
  chain (`1x7`) is what a sampled chain accepts today.
- **target-only**: the draft's k likeliest, no q (SGLang's rule, what a sampled tree shape
  accepts today): candidate j taken with p's share left after the ones before it.

Every emitted token is distributed as the target's p, so the continuation is the target's own
sampled text. Accepted drafts a round, and what a verify reads a round (the tree's nodes + 1),
per template and rule; writes JSON (default bench/out/tree_rrs.json).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import device_info, format_table, write_json
from bench.cpu.accept_rules import drawn, level
from bench.prompts import code_prompts
from specpair.runtime.sampling import SamplingParams, warp

RULES = ("recursive", "target-only")


def parse_template(text: str) -> tuple[int, ...]:
    """ "2x7" → (2,) * 7; "4,4,2,1" → (4, 4, 2, 1): candidates at each depth (each ≥ 1).
    ValueError names the template otherwise."""
    try:
        if "x" in text:
            k, depth = text.split("x")
            template = (int(k),) * int(depth)
        else:
            template = tuple(int(k) for k in text.split(","))
    except ValueError:
        template = ()
    if not template or min(template) < 1:
        raise ValueError(f'template {text!r}: "KxDEPTH" or "K1,K2,…", each K at least 1')
    return template


def likeliest(q: Tensor, k: int) -> tuple[list[int], list[Tensor]]:
    """The draft's k likeliest tokens, each with the one-hot q of the target-only rule."""
    tokens = q.topk(min(k, int((q > 0).sum()))).indices.tolist()
    return tokens, [
        torch.nn.functional.one_hot(torch.tensor(x), q.numel()).double() for x in tokens
    ]


@dataclass
class Tally:
    rounds: int = 0
    accepted: int = 0
    nodes: int = 0

    @property
    def accept(self) -> float:
        return self.accepted / max(self.rounds, 1)


class Pair:
    """The shipped target and draft LM at one sampling setting: warped next-token rows."""

    def __init__(self, models: Path, sampling: SamplingParams) -> None:
        load = AutoModelForCausalLM.from_pretrained
        self.target = load(models / "target", dtype=torch.float32).eval()
        self.draft = load(models / "draft", dtype=torch.float32).eval()
        self.sampling = sampling

    @torch.no_grad()
    def p_rows(self, ids: Sequence[int], extra: int) -> Tensor:
        """[extra + 1, V]: the target's p after each of the last extra + 1 tokens of ids."""
        logits = self.target(torch.tensor([list(ids)])).logits[0, -extra - 1 :]
        return warp(logits, self.sampling)

    @torch.no_grad()
    def q_row(self, ids: Sequence[int]) -> Tensor:
        return warp(self.draft(torch.tensor([list(ids)])).logits[0, -1], self.sampling)


def one_round(
    pair: Pair, ids: list[int], template: Sequence[int], rule: str, g: torch.Generator
) -> tuple[list[int], int]:
    """A round on `ids`: (the tokens it emits, accepted drafts)."""
    spine: list[int] = []
    levels: list[tuple[list[int], list[Tensor]]] = []
    for k in template:  # draft the spine tree
        q = pair.q_row(ids + spine)
        cands = drawn(q, k, g) if rule == "recursive" else likeliest(q, k)
        if not cands[0]:
            break
        levels.append(cands)
        spine.append(cands[0][0])
    p = pair.p_rows(ids + spine, len(spine))  # after the root and each spine node
    out: list[int] = []
    for d, (tokens, qs) in enumerate(levels):
        taken, token = level(p[d], tokens, qs, g)
        out.append(token)
        if taken != 0:  # a side leaf (its bonus follows), or none (the residual's token)
            if taken > 0:
                out.append(
                    int(torch.multinomial(pair.p_rows(ids + out, 0)[0].double(), 1, generator=g))
                )
            return out, len(out) - 1
    out.append(int(torch.multinomial(p[len(levels)].double(), 1, generator=g)))  # the bonus
    return out, len(out) - 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu tree-rrs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--prompts", type=int, default=8, help="held-out code prompts")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--templates", nargs="+", default=["1x7", "2x7", "4,4,2,2,1,1,1", "4x7"])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=Path("bench/out/tree_rrs.json"))
    args = parser.parse_args(argv)
    try:
        templates = [parse_template(t) for t in args.templates]
    except ValueError as exc:
        parser.error(str(exc))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    pair = Pair(args.models, sampling)
    tok = AutoTokenizer.from_pretrained(args.models / "target")
    prompts = code_prompts(tok, args.prompts, 96, 128)
    cells: list[dict[str, object]] = []
    rows: list[list[str]] = []
    for text, template in zip(args.templates, templates, strict=True):
        for rule in RULES:
            if rule == "target-only" and max(template) == 1:
                continue  # a chain without q: one-hot q, below the chain's rejection
            tally = Tally()
            for i, prompt in enumerate(prompts):
                g = torch.Generator().manual_seed(i)
                ids = list(prompt.ids)
                start = len(ids)
                while len(ids) - start < args.new_tokens:
                    out, accepted = one_round(pair, ids, template, rule, g)
                    ids += out
                    tally.rounds += 1
                    tally.accepted += accepted
                    tally.nodes += sum(template) + 1
            rounds, rows_a_round = tally.rounds, tally.nodes / tally.rounds
            cell = {"template": text, "rule": rule, "rounds": rounds, "accept": tally.accept}
            cells.append(cell | {"rows": rows_a_round})
            rows.append([text, rule, str(sum(template)), f"{tally.accept:.2f}", str(tally.rounds)])
            print(f"  {text} {rule}: {tally.accept:.2f} a round", flush=True)
    setting = {"temperature": args.temperature, "top_p": args.top_p}
    write_json(args.out, {"device": device_info(), **setting, "cells": cells})
    print(format_table(["template", "rule", "drafts", "accepted a round", "rounds"], rows))
