"""What a sampled draft would accept drawing its q at the request's temperature times F.

    python -m bench.cpu q-temperature [--code-prompts 16] [--factors 0.8 0.9 1 1.1] [--tier 7]

Rejection sampling is exact for any q the draft draws from, so the draft may warp its logits at
another temperature than the request's; what it accepts is the overlap sum_x min(p(x), q(x)) at
each drafted position (p: the target's warped distribution there). The EAGLE-3 head of the
shipped pair drafts every request alone, in process on the CPU, drawing at F = 1; at each step
its logits are warped at every F as `sampling.draft_support` warps them (K = `DRAFT_SUPPORT`
likeliest tokens), and at the verify each q is set against the target's p of the same position.
Along those contexts a round's expected accepted drafts at F are sum_i prod_{j<i} alpha_j, with
no sampling noise: the draws only pick the contexts.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import Tensor
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

import specpair.runtime.draft.drafter as drafter_module
import specpair.runtime.target.worker as worker_module
from bench.common import cpu_run, format_table, write_json
from bench.cpu.accept_lengths import EOT_ID, sampling_for
from bench.prompts import code_prompts
from specpair.runtime import sampling
from specpair.runtime.build import StateBuilder, build_drafter, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.shape import TreeShape

Overlaps = dict[float, list[float]]  # F -> alpha at each drafted position of a round


@contextmanager
def overlaps(factors: Sequence[float]) -> Iterator[list[Overlaps]]:
    """Within it, every verified sampled chain (one request a round) appends its rounds'
    overlaps at each factor; the drafts themselves are drawn at F = 1."""
    rounds: list[Overlaps] = []
    steps: list[dict[float, tuple[Tensor, Tensor]]] = []  # the draft's q at each F, a step each
    draw = sampling.draft_support
    accept = worker_module.accept_batch

    def support(
        logits: Tensor, params: sampling.RowParams, u: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor, Tensor]:
        qs = {}
        for f in factors:
            table = params.table.clone()
            table[:, 0] *= f
            _, ids, q = draw(logits, dataclasses.replace(params, table=table), u, *args, **kwargs)
            qs[f] = (ids[0], q[0])
        steps.append(qs)
        return draw(logits, params, u, *args, **kwargs)

    def verified(seqs: Any, trees: Any, logits: Tensor, *args: Any) -> Any:
        (seq,), (tree,) = seqs, trees
        drawn, n = steps[len(steps) - len(tree) :], len(tree)
        steps.clear()
        if n and not seq.sampling.greedy:
            p = [sampling.warp(logits[0, j], seq.sampling) for j in range(n)]

            def overlap(j: int, f: float) -> float:
                ids, q = drawn[j][f]
                return float(torch.minimum(p[j][ids], q).sum())

            rounds.append({f: [overlap(j, f) for j in range(n)] for f in factors})
        return accept(seqs, trees, logits, *args)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(drafter_module, "draft_support", support))
        stack.enter_context(mock.patch.object(worker_module, "accept_batch", verified))
        yield rounds


def expected_accepts(alphas: Sequence[float]) -> float:
    """A chain's expected accepted drafts from each position's acceptance: [0.7, 0.7] → 1.19."""
    total, reach = 0.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


def summary(
    rounds: Sequence[Overlaps], factors: Sequence[float], tier: int
) -> list[dict[str, Any]]:
    """Per factor: the mean acceptance at each position and a round's expected accepts."""
    rows = []
    for f in factors:
        by_position = [[r[f][j] for r in rounds if len(r[f]) > j] for j in range(tier)]
        rows.append(
            {
                "factor": f,
                "alpha_by_position": [sum(a) / len(a) if a else None for a in by_position],
                "expected_accepts": sum(expected_accepts(r[f]) for r in rounds) / len(rounds),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu q-temperature", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", type=Path, default=Path("models"), help="target + eagle3")
    parser.add_argument("--code-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[96, 128], metavar="N")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tier", type=int, default=7)
    parser.add_argument("--factors", type=float, nargs="+", default=[0.6, 0.8, 0.9, 1.0, 1.1, 1.25])
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/out/q_temperature.json"))
    args = parser.parse_args(argv)
    device = cpu_run(args.threads)
    hf_logging.set_verbosity_error()
    target_path, head = args.models / "target", args.models / "eagle3"
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompts = code_prompts(tokenizer, args.code_prompts, *args.prompt_tokens)
    sizes = dict(max_requests=1, max_len=args.prompt_tokens[1] + args.new_tokens + args.tier + 2)
    layers = feature_layers(head, target_path)
    target = build_target(target_path, keep_features=True, feature_layers=layers, **sizes)
    drafter = build_drafter(head, target_path=target_path, **sizes)
    state = StateBuilder(target, drafter).build(TreeShape(args.tier))
    engine = SpeculativeEngine(target, drafter)
    measured: list[int] = []  # accepted drafts a round, drawn at F = 1
    with overlaps(args.factors) as rounds:
        for i, prompt in enumerate(prompts):  # one at a time: a round's q is one request's
            (result,) = engine.generate(
                [prompt.ids],
                max_new_tokens=args.new_tokens,
                state=state,
                sampling=sampling_for([prompt], args.temperature, args.seed + i),
                stop_token_ids=frozenset({EOT_ID}),
            )
            measured += result.accept_lengths
    rows = summary(rounds, args.factors, args.tier)
    base = next((r["expected_accepts"] for r in rows if r["factor"] == 1.0), None)
    write_json(
        args.out,
        {
            "device": device,
            "args": vars(args) | {"models": str(args.models), "out": str(args.out)},
            "rounds": len(rounds),
            "measured_rounds": len(measured),
            "measured_accepts": sum(measured) / max(len(measured), 1),
            "factors": rows,
        },
    )
    print(
        f"{len(rounds)} rounds of {len(prompts)} code prompts at T {args.temperature}, tier "
        f"{args.tier}; drawn at F = 1 they accepted {sum(measured) / max(len(measured), 1):.3f} "
        "drafts a round"
    )
    table = [
        [
            f"{r['factor']:g}",
            " ".join(f"{a:.3f}" for a in r["alpha_by_position"] if a is not None),
            f"{r['expected_accepts']:.3f}",
            "-" if base is None else f"{r['expected_accepts'] / base:.3f}",
        ]
        for r in rows
    ]
    print(format_table(["F", "alpha by position", "expected accepts", "over F = 1"], table))
