"""One all-reduce inside a CUDA graph, NCCL against the one-shot peer-memory reduce
(`models/parallel.PeerReduce`), at the sizes a tensor-parallel target sums: a row-parallel
projection's float32 output, rows x hidden (8 rows: a batch-1 tier-7 verify; 64: batch 8).

Each rank captures 32 sums in a row into one graph and replays it; a sum's time is the graph's
GPU time over 32, on rank 0. Every replay's result is checked against the exact sum (rank r's
input is r + 1 everywhere, and each sum feeds the next, as a forward's do).

    python -m bench.tp_allreduce [--world 2] [--hidden 4096] [--rows 8 64 256 1024]
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import device_info, format_table, free_port, write_json
from specpair.models import parallel

SUMS = 32  # a graph's sums: as many as a forward's row-parallel layers, order of magnitude
REPLAYS = 20


def _time_graph(reduce: Any, x: torch.Tensor, world: int) -> tuple[float, bool]:
    """(microseconds a sum, every result exact) for SUMS chained sums of x."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm: NCCL's first call sets up outside the graph
        reduce(x.clone())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x.clone()  # NCCL sums in place: each replay starts again from x
        for _ in range(SUMS):
            y = reduce(y)
    # the first sum gives every rank 1 + ... + world, each next one multiplies by world: exact
    # in float32 (world 2: 3 * 2**31 after 32 sums)
    expected = float(sum(range(1, world + 1)) * world ** (SUMS - 1))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    exact = bool(torch.all(y == expected))
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    exact = exact and bool(torch.all(y == expected))
    return 1e3 * start.elapsed_time(end) / (REPLAYS * SUMS), exact


def _rank(rank: int, world: int, port: int, rows: list[int], hidden: int, out: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
        device_id=torch.device(f"cuda:{rank}"),
    )
    max_bytes = max(rows) * hidden * 4
    error = parallel.start_peer_reduce(torch.device(f"cuda:{rank}"), max_bytes)

    def nccl(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y)
        return y

    def peer(y: torch.Tensor) -> torch.Tensor:
        assert parallel._peer is not None
        return parallel._peer(y)

    cells = []
    for n in rows:
        x = torch.full((n, hidden), float(rank + 1), device=f"cuda:{rank}")
        cell: dict[str, Any] = {"rows": n, "hidden": hidden, "kib": n * hidden * 4 / 1024}
        cell["nccl_us"], cell["nccl_exact"] = _time_graph(nccl, x, world)
        if not error:
            cell["peer_us"], cell["peer_exact"] = _time_graph(peer, x, world)
        cells.append(cell)
    if rank == 0:
        out.put({"peer_error": error, "cells": cells})
    dist.barrier()
    os._exit(0)  # NCCL's group is left with the process (see parallel/ranks.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--out", type=Path, default=Path("bench/out/tp_allreduce.json"))
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank, args=(r, args.world, port, args.rows, args.hidden, results))
        for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    found = results.get(timeout=300)
    for proc in procs:
        proc.join(60)
    write_json(args.out, {"device": device_info(), "args": vars(args), **found})
    print(f"wrote {args.out}")
    if found["peer_error"]:
        print(f"peer memory unavailable: {found['peer_error']}")
    rows = [
        [
            str(c["rows"]),
            f"{c['kib']:.0f}",
            f"{c['nccl_us']:.1f}",
            f"{c.get('peer_us', float('nan')):.1f}",
            f"{c['nccl_us'] / c['peer_us']:.2f}" if "peer_us" in c else "-",
            f"{c['nccl_exact']}/{c.get('peer_exact', '-')}",
        ]
        for c in found["cells"]
    ]
    headers = ["rows", "KiB", "NCCL us", "peer us", "NCCL / peer", "exact NCCL/peer"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
