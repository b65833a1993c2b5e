"""Issue 52's goals: a tensor-parallel target as `specpair up --tensor-parallel N` starts it,
through the SDK, against the same target on one GPU, with and without speculation.

Deployments, each a `specpair up --device cuda` (the draft on rank 0's GPU, SGLang's rule, the
policy `up` ships), started one after another and kept up side by side on one machine of
≥ max(--tp) GPUs:

- `TP=N` for each N of --tp (default 1 and 2): the target on cuda:0 … cuda:N-1 (a target
  bigger than one GPU: leave 1 out, as the 70B run below).

Cells (held-out code prompts, greedy and T = 0.7 top-p 0.95 with a seed per request, each at
every --batches load): first each TP=N speculating; then every deployment pinned to tier 0
(the target alone: `up` builds it) and measured again. Ratios: `x TP=1`, a target alone over
TP=1's alone (same workload and load); `x alone`, speculation over its own deployment's alone.
Per cell from the target's RoundStats (bench.two_gpus.Account): mean verify ms of speculative
rounds and of plain ones. Per deployment: seconds from `up` to its ready line (the ones before
it already up and idle) and, once all are up, each GPU's memory in use (nvidia-smi: every
deployment's processes on that GPU together); and lossless, greedy: the first --check prompts'
tokens speculating against the same deployment's target alone (`identical` of `checked`; bf16
ties may part two outputs, issue 52's "up to the GPU tie rule").

    python -m bench.tensor_parallel [--tp 1 2] [--batches 1 8] [--requests 12 32] \\
        [--out bench/out/tensor_parallel.json]
    python -m bench.tensor_parallel --tp 4 --target-model /data/70b --draft-model /data/70b-eagle3
    python -m bench.tensor_parallel --device cpu --shape shipped --tp 2 --batches 1 \\
        --requests 2 --new-tokens 6 --warmup 0   # a CPU smoke run (gloo ranks)

JSON after every cell, the table last, a PNG of tokens/s by deployment and cell.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import device_info, format_optional, format_table, grouped_bars, write_json
from bench.gpu_speedup import Workload, add_pair_args, bench_pair, make_workloads, request_counts
from bench.services import wait_draft_connected
from bench.two_gpus import Account, run_cell
from bench.up_client import Up, pin_target_alone, running_up
from specpair.client import ControllerClient, SpecpairClient

SPECULATING, ALONE = "speculating", "target alone"


@dataclass
class TPCell:
    deployment: str  # "TP=1", "TP=2", …
    mode: str  # SPECULATING | ALONE
    workload: str
    clients: int
    tokens: int
    seconds: float
    account: Account
    x_tp1: float | None = None  # a target alone over TP=1's alone, same workload and clients
    x_alone: float | None = None  # speculating over its deployment's target alone

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def deployment(tp: int) -> str:
    return f"TP={tp}"


def up_command(args: argparse.Namespace, target: Path, draft: Path, tp: int) -> list[str]:
    kind = "eagle" if args.draft_kind.startswith("eagle") else "model"
    return [
        *(sys.executable, "-m", "specpair.cli", "up", "--device", args.device),
        *("--tensor-parallel", str(tp), "--draft-kind", kind),
        *("--target-model", str(target), "--draft-model", str(draft)),
    ]


def greedy_tokens(up: Up, wl: Workload, n: int, new_tokens: int) -> list[list[int]]:
    """The first `n` prompts of `wl`, one at a time: each one's generated token ids."""
    client = SpecpairClient(up.target, timeout=600)
    return [
        list(client.generate(wl.ids[i], max_tokens=new_tokens, temperature=0.0).token_ids)
        for i in range(min(n, len(wl.ids)))
    ]


def lossless(speculating: list[list[int]], alone: list[list[int]]) -> dict[str, Any]:
    """How many outputs match token for token, and where each other one first parts."""
    parted = [
        next((i for i, (a, b) in enumerate(zip(s, t, strict=False)) if a != b), min(len(s), len(t)))
        for s, t in zip(speculating, alone, strict=True)
        if s != t
    ]
    return {"checked": len(alone), "identical": len(alone) - len(parted), "parted_at": parted}


def gpu_memory() -> list[dict[str, Any]]:
    """Each GPU's memory in use and in all, MiB (nvidia-smi); [] where there is none."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "--query-gpu=index,memory.used,memory.total"
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    rows = [line.split(", ") for line in done.stdout.strip().splitlines() if line]
    return [{"gpu": int(i), "used_mib": int(u), "total_mib": int(t)} for i, u, t in rows]


def fill_ratios(cells: list[TPCell]) -> None:
    alone = {
        (c.deployment, c.workload, c.clients): c.tokens_per_s for c in cells if c.mode == ALONE
    }
    for c in cells:
        own = alone.get((c.deployment, c.workload, c.clients))
        tp1 = alone.get((deployment(1), c.workload, c.clients))
        c.x_alone = c.tokens_per_s / own if c.mode == SPECULATING and own else None
        c.x_tp1 = c.tokens_per_s / tp1 if c.mode == ALONE and tp1 else None


def render(cells: Sequence[TPCell]) -> str:
    rows = [
        [
            c.deployment,
            c.mode,
            c.workload,
            str(c.clients),
            f"{c.tokens_per_s:.1f}",
            format_optional(c.x_tp1, ".2f"),
            format_optional(c.x_alone, ".2f"),
            format_optional(c.account.accept, ".2f"),
            f"{c.account.verify_ms:.2f}" if c.account.rounds else "-",
            f"{c.account.plain_verify_ms:.2f}" if c.account.plain_rounds else "-",
        ]
        for c in sorted(cells, key=lambda c: (c.workload, c.clients, c.mode, c.deployment))
    ]
    headers = ["deployment", "mode", "workload", "clients", "tok/s", "x TP=1", "x alone"]
    return format_table([*headers, "accept", "verify ms", "plain verify ms"], rows)


def plot(cells: Sequence[TPCell], path: Path, title: str) -> None:
    series: dict[str, dict[str, float]] = {}
    for c in sorted(cells, key=lambda c: (c.workload, c.clients)):
        group = f"{c.workload}\n{c.clients} client{'s' * (c.clients > 1)}"
        series.setdefault(f"{c.deployment} {c.mode}", {})[group] = c.tokens_per_s
    grouped_bars(series, path, title, "tokens/s (SDK, all clients)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.set_defaults(draft_kind="eagle3")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="each deployment's ranks")
    parser.add_argument("--check", type=int, default=4, help="greedy prompts checked lossless")
    parser.add_argument("--target-model", type=Path, help="a pre-grown target (with --draft-model)")
    parser.add_argument("--draft-model", type=Path, help="its draft (default: --shape's pair)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="clients a cell")
    parser.add_argument(
        "--requests", type=int, nargs="+", default=[12, 32], help="one count, or one per batch"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--warmup", type=int, default=4, help="extra requests a load's warm-up runs (+ clients)"
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--top-p", type=float, default=0.95, help="of the sampled workloads")
    parser.add_argument("--out", type=Path, default=Path("bench/out/tensor_parallel.json"))
    args = parser.parse_args(argv)
    counts = request_counts(parser, args.batches, args.requests)
    if any(tp < 1 for tp in args.tp):
        parser.error("--tp: each deployment's ranks, 1 or more")
    if (args.target_model is None) != (args.draft_model is None):
        parser.error("--target-model and --draft-model go together")
    from transformers import AutoTokenizer

    info = device_info()
    print(f"device: {info}", flush=True)
    if args.target_model is not None:
        target, draft = args.target_model, args.draft_model
    else:
        grow_on = "cpu" if args.device == "cpu" else "cuda:0"
        target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, grow_on)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    workloads = [
        wl
        for wl in make_workloads(tokenizer, max(counts.values()), args.temperatures, args.top_p)
        if wl.prompts == "code"
    ]
    ranks = sorted(set(args.tp))
    commands = {deployment(tp): up_command(args, target, draft, tp) for tp in ranks}
    starts: dict[str, float] = {}
    memory: list[dict[str, Any]] = []
    cells: list[TPCell] = []
    checks: dict[str, dict[str, Any]] = {}
    greedy = next((wl for wl in workloads if wl.temperature == 0), None)
    speculated: dict[str, list[list[int]]] = {}

    def save() -> None:
        write_json(
            args.out,
            {
                "device": info,
                "date": time.strftime("%Y-%m-%d"),
                "commands": commands,
                "draft_kind": args.draft_kind,
                "target": str(target),
                "draft": str(draft),
                "new_tokens": args.new_tokens,
                "requests": counts,
                "top_p": args.top_p,
                "start_s": starts,
                "gpu_memory": memory,
                "lossless": checks,
                "cells": [asdict(c) | {"tokens_per_s": c.tokens_per_s} for c in cells],
            },
        )

    def record(name: str, mode: str, wl: Workload, clients: int, n: int, up: Up) -> None:
        cell = TPCell(name, mode, wl.name, clients, *run_cell(up, wl, clients, n, args.new_tokens))
        cells.append(cell)
        a = cell.account
        verify = a.verify_ms if a.rounds else a.plain_verify_ms
        print(
            f"  {name:6s} {mode:12s} {wl.name:18s} {clients:2d} clients "
            f"{cell.tokens_per_s:8.1f} tok/s  accept {format_optional(a.accept, '.2f')} "
            f"verify {verify:.2f} ms",
            flush=True,
        )
        fill_ratios(cells)
        save()

    log_dir = args.out.parent / f"{args.out.stem}_logs"
    with ExitStack() as stack:
        # One after another: each start-up time is its own (not shared with another's loading
        # and compiling), and two `up`s choosing free ports at once cannot pick the same one.
        print(f"starting {len(commands)} deployments, one after another …", flush=True)
        ups: dict[str, Up] = {}
        for name in commands:
            t0 = time.perf_counter()
            ups[name] = stack.enter_context(running_up(commands[name], log_dir / f"{name}.log"))
            starts[name] = time.perf_counter() - t0
        for up in ups.values():
            wait_draft_connected(SpecpairClient(up.target, timeout=60))
        memory += gpu_memory()
        print(f"up in {', '.join(f'{n} {s:.0f} s' for n, s in starts.items())}", flush=True)
        for up in ups.values():  # kernels compiled, graphs warm, before any cell counts
            for wl in workloads:
                for clients in counts:
                    run_cell(up, wl, clients, clients + args.warmup, args.new_tokens)
        for wl in workloads:
            for clients, n in counts.items():
                for name, up in ups.items():
                    if name != deployment(1):
                        record(name, SPECULATING, wl, clients, n, up)
        if greedy is not None:
            for name, up in ups.items():
                speculated[name] = greedy_tokens(up, greedy, args.check, args.new_tokens)
        for up in ups.values():
            pin_target_alone(ControllerClient(up.controller, token=up.token, timeout=30))
        if greedy is not None:
            for name, up in ups.items():
                alone = greedy_tokens(up, greedy, args.check, args.new_tokens)
                checks[name] = lossless(speculated[name], alone)
                print(f"  {name} lossless (greedy): {checks[name]}", flush=True)
            save()
        for wl in workloads:
            for clients, n in counts.items():
                for name, up in ups.items():
                    record(name, ALONE, wl, clients, n, up)
    gpu = info.get("gpu", info["cpu"])
    plot(cells, args.out.with_suffix(".png"), f"specpair up --tensor-parallel, {gpu}")
    print(f"\nwrote {args.out}\n")
    print("start to ready: " + ", ".join(f"{n} {s:.1f} s" for n, s in starts.items()))
    for row in memory:
        print(f"GPU {row['gpu']}: {row['used_mib']} / {row['total_mib']} MiB in use")
    for name, check in checks.items():
        print(f"{name}: {check['identical']} of {check['checked']} greedy outputs identical")
    print(render(cells))


if __name__ == "__main__":
    main()
