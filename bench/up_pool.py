"""Several `bench.up_client` runs pooled into a verdict: per cell (door, workload, clients) each
run's x over the tier 0 of its own `up`, the pooled x (the mean of the runs' tokens/s over the
mean of their tier 0's), how far each side moved between runs, and how many runs met a goal.

One run a cell spreads 10-15 % at 32 and 64 clients, most of it in the target alone's tokens/s
(a tier-0 round is short and mostly host time): a verdict needs several runs, each pairing
its configuration with the tier 0 measured beside it.

    python -m bench.up_pool RUN.json [RUN.json ...] [--config sglang] \\
        [--goals 8=2.5,1.8 32=1.6,1.4 64=1.3,1.2] [--out bench/out/up_pool.json]

`--goals CLIENTS=GREEDY,SAMPLED`: the x a greedy cell and a sampled one (any other workload)
must reach at that many clients (default: issue 54's).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table, read_json, write_json

ISSUE_54 = {8: (2.5, 1.8), 32: (1.6, 1.4), 64: (1.3, 1.2)}

Key = tuple[str, str, int]  # (door, workload, clients)


@dataclass(frozen=True, slots=True)
class Pooled:
    door: str
    workload: str
    clients: int
    runs: tuple[float, ...]  # each run's x over its own tier 0, in the order given
    pooled: float  # mean tokens/s over the mean of the tier 0's
    ours_spread: float  # (fastest - slowest) / slowest of the configuration's tokens/s
    alone_spread: float  # the same of tier 0's
    goal: float | None
    met: int  # runs whose x reached the goal


def pairs(run: Mapping[str, Any], config: str) -> dict[Key, tuple[float, float]]:
    """A run's cells of `config` with the tier 0 beside each: key → (tok/s, tier 0's tok/s)."""
    cells = run["cells"]
    alone = {
        (c["door"], c["workload"], c["batch"]): c["tokens_per_s"]
        for c in cells
        if c["config"] == "tier 0"
    }
    return {
        key: (c["tokens_per_s"], alone[key])
        for c in cells
        if c["config"] == config and (key := (c["door"], c["workload"], c["batch"])) in alone
    }


def spread(values: Sequence[float]) -> float:
    return (max(values) - min(values)) / min(values)


def pool(
    runs: Sequence[Mapping[str, Any]],
    config: str,
    goals: Mapping[int, tuple[float, float]] = ISSUE_54,
) -> list[Pooled]:
    """Each cell any run holds for `config` beside a tier 0, over the runs that hold it.

    Worked example: two runs at 8 clients greedy, (2800, 1160) and (2830, 1130) tok/s: x 2.41
    and 2.50; pooled 2815 / 1145 = 2.46; spreads 1.1 % and 2.7 %; against 2.5, one run met."""
    by_cell: dict[Key, list[tuple[float, float]]] = {}
    for run in runs:
        for key, pair in pairs(run, config).items():
            by_cell.setdefault(key, []).append(pair)
    out = []
    for (door, workload, clients), got in sorted(by_cell.items()):
        xs = tuple(ours / alone for ours, alone in got)
        ours_tps, alone_tps = [o for o, _ in got], [a for _, a in got]
        goal_pair = goals.get(clients)
        goal = None if goal_pair is None else goal_pair[0 if "greedy" in workload else 1]
        out.append(
            Pooled(
                door,
                workload,
                clients,
                xs,
                sum(ours_tps) / sum(alone_tps),
                spread(ours_tps),
                spread(alone_tps),
                goal,
                0 if goal is None else sum(x >= goal for x in xs),
            )
        )
    return out


def goal_arg(text: str) -> tuple[int, tuple[float, float]]:
    """ "8=2.5,1.8" → (8, (2.5, 1.8))."""
    try:
        clients, _, xs = text.partition("=")
        greedy, sampled = (float(x) for x in xs.split(","))
        return int(clients), (greedy, sampled)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected CLIENTS=GREEDY,SAMPLED, e.g. 8=2.5,1.8"
        ) from None


def render(cells: Sequence[Pooled]) -> str:
    rows = [
        [
            c.door,
            c.workload,
            str(c.clients),
            ", ".join(f"{x:.2f}" for x in c.runs),
            f"{c.pooled:.2f}",
            f"{100 * c.ours_spread:.0f} %",
            f"{100 * c.alone_spread:.0f} %",
            "-" if c.goal is None else f"{c.goal:g}",
            "-" if c.goal is None else f"{c.met} of {len(c.runs)}",
        ]
        for c in cells
    ]
    headers = ["door", "workload", "clients", "x, each run", "pooled x", "spread", "tier 0 spread"]
    return format_table([*headers, "goal", "met"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.up_pool", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("runs", type=Path, nargs="+", help="bench.up_client JSON files")
    parser.add_argument("--config", default="sglang", help="the configuration to pool")
    parser.add_argument("--goals", type=goal_arg, nargs="*", help="CLIENTS=GREEDY,SAMPLED")
    parser.add_argument("--out", type=Path, default=Path("bench/out/up_pool.json"))
    args = parser.parse_args(argv)
    goals = ISSUE_54 if args.goals is None else dict(args.goals)
    cells = pool([read_json(path) for path in args.runs], args.config, goals)
    if not cells:
        parser.error(f"no run holds a {args.config!r} cell beside a tier 0 one")
    runs = [str(path) for path in args.runs]
    write_json(args.out, {"runs": runs, "config": args.config, "cells": cells})
    print(f"wrote {args.out}\n")
    print(render(cells))


if __name__ == "__main__":
    main()
