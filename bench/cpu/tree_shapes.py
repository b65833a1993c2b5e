"""Tokens/s by tier shape and batch through the two services (CPU): chains against trees.

Each shape runs in fresh service processes (`serve target/draft --tree-shapes`, the shape its
first and only tier: no controller), beside the target alone (`--no-draft`), on the same
held-out code prompts, greedy, closed loop: `batch` clients each send their next request when
the last one finished. A tree accepts more per round but verifies `num_draft_tokens + 1` tokens
per request and drafts `topk` rows per step, so it wins where a round costs little more for more
tokens (small batches) and loses as the batch grows.

    python -m bench.cpu trees [--shapes 3 7 3x2x6 4x4x16 6x4x24] [--batches 1 4 16]
        [--requests 16] [--new-tokens 48] [--draft-kind eagle] [--adaptive]
        [--out bench/out/tree_shapes.json]

`--adaptive` adds a row for the controller's goodput kind over every shape of the run (chains
1 / 3 / 7 and the trees), started fresh on chain 3: what it chose, by rounds, is printed.

Prints a table (tokens/s and × the target alone per batch, mean accepted drafts per round),
writes JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.common import device_info, format_table, write_json
from bench.prompts import code_prompts
from bench.services import BenchServices, wait_draft_connected, watch_rounds
from specpair.client import SpecpairClient
from specpair.config import MODELS_DIR
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import TreeShape

ALONE = "target alone"
ADAPTIVE = "goodput"  # the controller's goodput kind choosing among every shape of the run
CHAINS = (1, 3, 7)  # built beside each tree (a target needs a chain tier to start on)


@dataclass(frozen=True, slots=True)
class Cell:
    shape: str
    batch: int
    tokens: int
    seconds: float
    mean_accept: float  # accepted drafts per drafted request-round (bonus excluded)
    rounds: int
    tiers: dict[str, int]  # drafted rounds by the tier they ran at

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_shape(shape: str, prompts: list[list[int]], args: argparse.Namespace) -> list[Cell]:
    """Every batch of `args.batches` at `shape` (or the target alone, or the goodput policy
    over every shape of the run) in one service group."""
    shapes = [TreeShape.parse(s) for s in args.shapes]
    trees = [str(t) for t in shapes if not t.is_chain]
    policy = None
    if shape == ADAPTIVE:  # every tree built; the controller chooses, starting on chain 3
        tree: TreeShape | None = TreeShape(3)
        built = trees
        policy = {"kind": "goodput", "candidate_steps": list(CHAINS), "tree_shapes": trees}
    else:
        tree = None if shape == ALONE else TreeShape.parse(shape)
        built = [] if tree is None or tree.is_chain else [shape]
    flags = tuple(arg for t in built for arg in ("--tree-shapes", t))
    initial = ("--initial-shape", shape) if built and policy is None else ()
    log_dir = args.log_dir / shape.replace(" ", "_")
    log_dir.mkdir(parents=True, exist_ok=True)
    with BenchServices(
        target=args.target,
        draft=None if tree is None else args.draft,
        draft_kind=args.draft_kind,
        log_dir=log_dir,
        policy=policy,
        initial_steps=tree.steps if tree is not None and tree.is_chain else CHAINS[0],
        candidate_steps=CHAINS,
        draft_options=flags,
        target_options=(*flags, *initial, "--max-batch", str(max(args.batches))),
    ) as group:
        client = SpecpairClient(group.target, timeout=600)
        if tree is not None:
            wait_draft_connected(client)
        for prompt in prompts[:2]:  # warm-up: first calls, allocator
            client.generate(prompt, max_tokens=8)
        cells = []
        for batch in args.batches:
            rounds: list[RoundStats] = []
            call = watch_rounds(group.target, rounds)
            time.sleep(0.3)
            jobs = [prompts[i % len(prompts)] for i in range(max(args.requests, batch))]

            def one(prompt: list[int]) -> int:
                return len(client.generate(prompt, max_tokens=args.new_tokens).token_ids)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                tokens = sum(pool.map(one, jobs))
            seconds = time.perf_counter() - t0
            time.sleep(0.3)
            call.cancel()
            accepts = [a for r in rounds for a in r.accept_lengths]
            mean = sum(accepts) / len(accepts) if accepts else 0.0
            chosen = Counter(str(r.tier) for r in rounds if r.accept_lengths)
            cell = Cell(shape, batch, tokens, seconds, mean, len(rounds), dict(chosen))
            cells.append(cell)
            share = ", ".join(f"{t} {n / max(len(rounds), 1):.0%}" for t, n in chosen.most_common())
            print(
                f"  {shape:12s} batch {batch:3d}: {cell.tokens_per_s:7.1f} tok/s, "
                f"accept {mean:.2f}, {len(rounds)} rounds ({share})",
                flush=True,
            )
    return cells


def render(cells: list[Cell], shapes: list[str], batches: list[int]) -> str:
    by = {(c.shape, c.batch): c for c in cells}
    headers = ["shape"] + [f"batch {b}" for b in batches] + ["accept (b=1)"]
    rows = []
    for shape in [ALONE, *shapes, *([ADAPTIVE] if ADAPTIVE in {c.shape for c in cells} else [])]:
        row = [shape]
        for b in batches:
            c, alone = by[(shape, b)], by[(ALONE, b)]
            ratio = c.tokens_per_s / alone.tokens_per_s
            row.append(f"{c.tokens_per_s:.1f} ({ratio:.2f}×)")
        row.append("—" if shape == ALONE else f"{by[(shape, batches[0])].mean_accept:.2f}")
        rows.append(row)
    return format_table(headers, rows)


def plot(cells: list[Cell], shapes: list[str], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(c.shape, c.batch): c for c in cells}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for shape in [ALONE, *shapes, *([ADAPTIVE] if ADAPTIVE in {c.shape for c in cells} else [])]:
        ys = [by[(shape, b)].tokens_per_s for b in batches]
        style = {ALONE: "--", ADAPTIVE: ":"}.get(shape, "-")
        ax.plot(batches, ys, marker="o", linestyle=style, label=shape)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (concurrent clients)")
    ax.set_ylabel("tokens/s")
    ax.set_title("tokens/s by tier shape and batch, through the services (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu trees",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--draft", type=Path, default=MODELS_DIR / "eagle")
    parser.add_argument("--draft-kind", choices=["model", "eagle"], default="eagle")
    parser.add_argument("--shapes", nargs="+", default=["3", "7", "3x2x6", "4x4x16", "6x4x24"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="per batch (at least batch)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="add the goodput policy choosing among every shape of the run (a controller)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/tree_shapes.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/tree_shapes-logs"))
    args = parser.parse_args(argv)
    for shape in args.shapes:
        TreeShape.parse(shape)  # a bad one fails here, not after the first runs
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    prompts = [p.ids for p in code_prompts(tokenizer, 8, 64, 128)]
    device = device_info()
    print(f"device: {device['cpu']}; {len(prompts)} held-out code prompts, greedy")
    cells: list[Cell] = []
    for shape in [ALONE, *args.shapes, *([ADAPTIVE] if args.adaptive else [])]:
        cells += run_shape(shape, prompts, args)
    settings: dict[str, Any] = {k: str(v) for k, v in vars(args).items()}
    write_json(args.out, {"device": device, "settings": settings, "cells": cells})
    png = args.out.with_suffix(".png")
    plot(cells, args.shapes, args.batches, png)
    print(f"wrote {args.out} and {png}\n")
    print(render(cells, args.shapes, args.batches))
