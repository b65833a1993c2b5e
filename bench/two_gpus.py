"""Two GPUs against one: the pair as `specpair up` starts it, with the draft on the target's GPU
or on a GPU of its own, through the SDK, at 1 / 8 / 32 concurrent clients, greedy and sampled.

Deployments, each a `specpair up` (default policy: SGLang's rule over tiers 1/3/7), all started
side by side on one two-GPU machine and measured one at a time, cell by cell in turn, so that
each two-GPU cell has its one-GPU twin measured beside it:

- `1 GPU`: `up --device cuda:0` (the draft shares the target's GPU);
- `2 GPUs`: `up --device cuda:0 --draft-device cuda:1`, as a user types it;
- `target alone`: the `1 GPU` deployment pinned to tier 0 (its runtime state is built by
  `up`), measured last.

Per cell, from the target's RoundStats, where a round's time goes: verify (wall), the wait for
the draft's messages, the draft's own time (its extend + steps) and the round (total). Before
its cells each deployment runs a warm-up of every workload and load (kernels compiled).
Held-out code prompts (`bench.prompts`), greedy and T = 0.7 (top-p 0.95, a seed per request).

    python -m bench.two_gpus --draft-kind eagle3 [--batches 1 8 32] [--out bench/out/two_gpus.json]
    python -m bench.two_gpus --draft-kind model
    python -m bench.two_gpus --device cpu --shape shipped --batches 1 --requests 2 \\
        --new-tokens 8 --deployments "1 GPU" "2 GPUs"   # a CPU smoke run of the harness

JSON after every cell, the table last, a PNG of tokens/s by deployment and load.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import device_info, format_optional, format_table, grouped_bars, write_json
from bench.gpu_speedup import Workload, add_pair_args, bench_pair, make_workloads, request_counts
from bench.services import rounds_watched, wait_draft_connected
from bench.up_client import Up, pin_target_alone, running_up, sdk_door
from specpair.client import ControllerClient, SpecpairClient
from specpair.runtime.round_messages import RoundStats

# name → (target device, draft device)
DEPLOYMENTS: dict[str, tuple[str, str]] = {
    "1 GPU": ("cuda:0", "cuda:0"),
    "2 GPUs": ("cuda:0", "cuda:1"),
}
ALONE = "target alone"


@dataclass
class Account:
    """Where a cell's rounds went: means per speculative round, from its RoundStats."""

    rounds: int
    accept: float | None  # accepted drafts per request-round
    round_ms: float
    verify_ms: float
    wait_ms: float  # the target waited for the draft's messages
    draft_ms: float  # the draft's extend + steps (its own clock)
    rpc_ms: float
    plain_rounds: int = 0  # rounds without drafts (the target alone's are all such)
    plain_verify_ms: float = 0.0

    @classmethod
    def of(cls, stats: Sequence[RoundStats]) -> Account:
        spec = [r for r in stats if r.speculative]
        plain = [r.timings.verify_ms for r in stats if not r.speculative]
        n = max(len(spec), 1)
        accepts = [a for r in spec for a in r.accept_lengths]

        def mean(name: str) -> float:
            return sum(getattr(r.timings, name) for r in spec) / n

        return cls(
            rounds=len(spec),
            accept=sum(accepts) / len(accepts) if accepts else None,
            round_ms=mean("total_ms"),
            verify_ms=mean("verify_ms"),
            wait_ms=mean("wait_ms"),
            draft_ms=mean("extend_ms") + mean("draft_ms"),
            rpc_ms=mean("rpc_ms"),
            plain_rounds=len(plain),
            plain_verify_ms=sum(plain) / max(len(plain), 1),
        )


@dataclass
class TwoCell:
    deployment: str
    workload: str
    clients: int
    tokens: int
    seconds: float
    account: Account
    x_one_gpu: float | None = None  # tokens/s over the `1 GPU` deployment's same cell
    x_alone: float | None = None  # over the target alone's

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def up_command(args: argparse.Namespace, target: Path, draft: Path, name: str) -> list[str]:
    target_device, draft_device = DEPLOYMENTS[name]
    if args.device == "cpu":
        target_device = draft_device = "cpu"
    return [
        sys.executable,
        "-m",
        "specpair.cli",
        "up",
        "--device",
        target_device,
        "--draft-device",
        draft_device,
        "--target-model",
        str(target),
        "--draft-model",
        str(draft),
        "--draft-kind",
        "eagle" if args.draft_kind.startswith("eagle") else "model",
    ]


def run_cell(
    up: Up, wl: Workload, clients: int, n: int, new_tokens: int
) -> tuple[int, float, Account]:
    """`n` requests of `wl`, `clients` at a time through the SDK: (tokens, seconds, account)."""
    one = sdk_door(up)
    stats: list[RoundStats] = []

    def request(i: int) -> int:
        return one(wl.ids[i % len(wl.ids)], new_tokens, wl.sampling(i))

    with rounds_watched(up.target, stats, up.token, before_s=0.2):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            tokens = sum(pool.map(request, range(n)))
        seconds = time.perf_counter() - t0
    return tokens, seconds, Account.of(stats)


def fill_ratios(cells: list[TwoCell]) -> None:
    def base(name: str) -> dict[tuple[str, int], float]:
        return {(c.workload, c.clients): c.tokens_per_s for c in cells if c.deployment == name}

    one, alone = base("1 GPU"), base(ALONE)
    for c in cells:
        key = (c.workload, c.clients)
        c.x_one_gpu = c.tokens_per_s / one[key] if key in one else None
        c.x_alone = c.tokens_per_s / alone[key] if key in alone else None


def render(cells: Sequence[TwoCell]) -> str:
    rows = [
        [
            c.deployment,
            c.workload,
            str(c.clients),
            f"{c.tokens_per_s:.1f}",
            format_optional(c.x_one_gpu, ".2f"),
            format_optional(c.x_alone, ".2f"),
            format_optional(c.account.accept, ".2f"),
            f"{c.account.round_ms:.2f}",
            f"{c.account.verify_ms:.2f}",
            f"{c.account.wait_ms:.2f}",
            f"{c.account.draft_ms:.2f}",
        ]
        for c in sorted(cells, key=lambda c: (c.workload, c.clients))
    ]
    headers = [
        "deployment",
        "workload",
        "clients",
        "tok/s",
        "x 1 GPU",
        "x alone",
        "accept",
        "round ms",
        "verify",
        "wait",
        "draft",
    ]
    return format_table(headers, rows)


def plot(cells: Sequence[TwoCell], path: Path, title: str) -> None:
    series: dict[str, dict[str, float]] = {}
    for c in sorted(cells, key=lambda c: (c.workload, c.clients)):
        group = f"{c.workload}\n{c.clients} client{'s' * (c.clients > 1)}"
        series.setdefault(c.deployment, {})[group] = c.tokens_per_s
    grouped_bars(series, path, title, "tokens/s (SDK, all clients)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients of each cell"
    )
    parser.add_argument(
        "--requests",
        type=int,
        nargs="+",
        default=[12, 32, 64],
        help="requests per cell: one count, or one per batch",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--top-p", type=float, default=0.95, help="of the sampled workloads")
    parser.add_argument(
        "--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS)
    )
    parser.add_argument("--no-alone", action="store_true", help="skip the target-alone cells")
    parser.add_argument("--out", type=Path, default=Path("bench/out/two_gpus.json"))
    args = parser.parse_args(argv)
    counts = request_counts(parser, args.batches, args.requests)
    if "1 GPU" not in args.deployments:
        parser.error("--deployments: every ratio is over '1 GPU', which must be among them")
    from transformers import AutoTokenizer

    info = device_info()
    print(f"device: {info}", flush=True)
    grow_on = "cpu" if args.device == "cpu" else "cuda:0"
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, grow_on)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    workloads = [
        wl
        for wl in make_workloads(tokenizer, max(counts.values()), args.temperatures, args.top_p)
        if wl.prompts == "code"
    ]
    commands = {name: up_command(args, target, draft, name) for name in args.deployments}
    cells: list[TwoCell] = []

    def record(name: str, wl: Workload, clients: int, measured: tuple[int, float, Account]) -> None:
        cell = TwoCell(name, wl.name, clients, *measured)
        cells.append(cell)
        a = cell.account
        print(
            f"  {name:18s} {wl.name:18s} {clients:2d} clients {cell.tokens_per_s:8.1f} tok/s  "
            f"accept {format_optional(a.accept, '.2f')} round {a.round_ms:.2f} ms "
            f"verify {a.verify_ms:.2f} wait {a.wait_ms:.2f}",
            flush=True,
        )
        fill_ratios(cells)
        write_json(
            args.out,
            {
                "device": info,
                "date": time.strftime("%Y-%m-%d"),
                "commands": commands,
                "draft_kind": args.draft_kind,
                "shape": args.shape,
                "new_tokens": args.new_tokens,
                "requests": counts,
                "top_p": args.top_p,
                "cells": [asdict(c) | {"tokens_per_s": c.tokens_per_s} for c in cells],
            },
        )

    log_dir = args.out.parent / f"{args.out.stem}_logs"
    with ExitStack() as stack:
        t0 = time.perf_counter()
        print(f"starting {len(commands)} deployments side by side …", flush=True)

        def start(name: str) -> Up:
            log = log_dir / f"{name.replace(' ', '_')}.log"
            return stack.enter_context(running_up(commands[name], log))

        with ThreadPoolExecutor(len(commands)) as pool:
            ups = dict(zip(commands, pool.map(start, commands), strict=True))
        for up in ups.values():
            wait_draft_connected(SpecpairClient(up.target, timeout=60))
        print(f"all up in {time.perf_counter() - t0:.0f} s; warming up", flush=True)
        for name, up in ups.items():
            t0 = time.perf_counter()
            for wl in workloads:
                for clients in counts:
                    run_cell(up, wl, clients, max(4, clients + 4), args.new_tokens)
            print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        for wl in workloads:
            for clients, n in counts.items():
                for name, up in ups.items():
                    record(name, wl, clients, run_cell(up, wl, clients, n, args.new_tokens))
        if not args.no_alone:
            one = ups["1 GPU"]
            pin_target_alone(ControllerClient(one.controller, token=one.token, timeout=30))
            for wl in workloads:
                for clients, n in counts.items():
                    record(ALONE, wl, clients, run_cell(one, wl, clients, n, args.new_tokens))
    gpu = info.get("gpu", info["cpu"])
    plot(cells, args.out.with_suffix(".png"), f"specpair up, {args.draft_kind}, {gpu}")
    print(f"\nwrote {args.out}\n")
    print(render(cells))


if __name__ == "__main__":
    main()
