"""Several `bench.up_client` runs pooled into a verdict: per cell (door, workload, clients) each
run's x over the tier 0 of its own `up`, the pooled x (the mean of the runs' tokens/s over the
mean of their tier 0's), how far each side moved between runs, and how many runs met a goal.
Where a run holds a greedy and a sampled cell at one load, it also splits the sampled x's share
of the greedy one into its factors (`shares`), and names the greedy x a sampled goal asks for.

One run a cell spreads 10-15 % at 32 and 64 clients, most of it in the target alone's tokens/s
(a tier-0 round is short and mostly host time): a verdict needs several runs, each pairing
its configuration with the tier 0 measured beside it.

    python -m bench.up_pool RUN.json [RUN.json ...] [--config sglang] \\
        [--goals 8=2.5,1.8 32=1.6,1.4 64=1.3,1.2] [--out bench/out/up_pool.json]

writes the JSON and a PNG beside it (x against clients: pooled, each run, the goals).

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


@dataclass(frozen=True, slots=True)
class Share:
    """A sampled cell's x over the greedy cell's at one load in the same runs (means over the
    runs), and its factors, whose product it is up to the time outside rounds: tokens a round
    ((1 + accepted drafts), sampled over greedy), the batch held (sampled over greedy), the
    round (greedy's time over sampled's: above 1 a sampled round is cheaper) and the target
    alone (its greedy tok/s over its sampled)."""

    door: str
    clients: int
    runs: int
    share: float
    tokens: float
    batch: float
    round: float
    alone: float
    needs: float | None  # the greedy x at which this share meets the sampled goal


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


def shares(
    runs: Sequence[Mapping[str, Any]],
    config: str,
    goals: Mapping[int, tuple[float, float]] = ISSUE_54,
) -> list[Share]:
    """Per (door, clients) where a run holds `config`'s greedy and sampled cells with their
    round stats, each beside a tier 0.

    Worked example (8 clients, one run): greedy accepts 4.3 drafts a round (5.3 tokens) in 13 ms
    rounds at batch 7.5, x 2.7; sampled 2.5 (3.5 tokens) in 14.6 ms at 7.5, x 1.66; tier 0 1160 /
    1110 tok/s: share 0.614 = tokens 0.660 × batch 1 × round 0.890 × alone 1.045, and a sampled
    goal of 1.8 asks a greedy x of 1.8 / 0.614 = 2.93."""
    got: dict[tuple[str, int], list[tuple[float, ...]]] = {}
    for run in runs:
        paired = pairs(run, config)  # key → (tok/s, tier 0's tok/s)
        rounds = {
            (c["door"], c["workload"], c["batch"]): c["rounds"]
            for c in run["cells"]
            if c["config"] == config and "rounds" in c
        }
        for (door, workload, clients), (ours_s, alone_s) in paired.items():
            # "code T=0.7 p=0.95" beside "code greedy": the same prompts
            greedy_key = (door, f"{workload.split()[0]} greedy", clients)
            sampled_key = (door, workload, clients)
            if "greedy" in workload or greedy_key not in paired:
                continue
            if sampled_key not in rounds or greedy_key not in rounds:
                continue
            (ours_g, alone_g), g, s = paired[greedy_key], rounds[greedy_key], rounds[sampled_key]
            got.setdefault((door, clients), []).append(
                (
                    (ours_s / alone_s) / (ours_g / alone_g),
                    (1 + s["accept"]) / (1 + g["accept"]),
                    s["batch"] / g["batch"],
                    g["total"] / s["total"],
                    alone_g / alone_s,
                )
            )
    out = []
    for (door, clients), rows in sorted(got.items()):
        share, tokens, batch, round_, alone = (
            sum(col) / len(rows) for col in zip(*rows, strict=True)
        )
        goal = goals.get(clients)
        needs = None if goal is None else goal[1] / share
        out.append(Share(door, clients, len(rows), share, tokens, batch, round_, alone, needs))
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


def render_shares(rows: Sequence[Share]) -> str:
    headers = ["door", "clients", "runs", "share", "tokens a round", "batch", "round", "alone"]
    return format_table(
        [*headers, "greedy x the sampled goal asks"],
        [
            [
                r.door,
                str(r.clients),
                str(r.runs),
                *(f"{v:.3f}" for v in (r.share, r.tokens, r.batch, r.round, r.alone)),
                "-" if r.needs is None else f"{r.needs:.2f}",
            ]
            for r in rows
        ],
    )


def plot(cells: Sequence[Pooled], path: Path, title: str) -> None:
    """Speed-up against clients, a line a workload: the pooled x, each run's x as a dot, the
    goals as crosses (one door: the first of `cells`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    door = cells[0].door
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for workload in dict.fromkeys(c.workload for c in cells):
        mine = [c for c in cells if (c.door, c.workload) == (door, workload)]
        mine.sort(key=lambda c: c.clients)
        xs, pooled = [c.clients for c in mine], [c.pooled for c in mine]
        colour = ax.plot(xs, pooled, marker="o", label=f"{workload}, pooled")[0].get_color()
        for c in mine:
            ax.scatter([c.clients] * len(c.runs), c.runs, s=10, color=colour, alpha=0.5)
            if c.goal is not None:
                ax.scatter([c.clients], [c.goal], marker="x", s=50, color=colour)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ticks = sorted({c.clients for c in cells})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("x over tier 0 (the target alone); x: goal")
    ax.set_title(f"{title} ({door}; dots: each run)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    loaded = [read_json(path) for path in args.runs]
    cells = pool(loaded, args.config, goals)
    if not cells:
        parser.error(f"no run holds a {args.config!r} cell beside a tier 0 one")
    split = shares(loaded, args.config, goals)
    runs = [str(path) for path in args.runs]
    write_json(args.out, {"runs": runs, "config": args.config, "cells": cells, "shares": split})
    plot(cells, args.out.with_suffix(".png"), f"python -m bench.up_pool, {args.config}")
    print(f"wrote {args.out} and its .png\n")
    if split:
        print("sampled x over greedy x, each factor sampled over greedy (means over runs):")
        print(render_shares(split) + "\n")
    print(render(cells))


if __name__ == "__main__":
    main()
