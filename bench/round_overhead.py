"""Per-round cost of the two-service deployment vs the in-process engine, same models, CPU.

Both run the same greedy workload (a batch of concurrent requests at a fixed tier). In-process
rounds split into draft / verify / accept bookkeeping; service rounds, as the target reports
them on WatchRounds, into draft (the draft's own compute) / verify / serialization + gRPC (round
trip minus draft compute) / scheduling (admission, bookkeeping, streaming).

    python -m bench.round_overhead [--target models/target --draft models/draft] [--tier 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.common import add_output_args, device_info, format_table, percentile, write_json
from bench.services import ServiceGroup, watch_rounds
from specpair.client import SpecpairClient
from specpair.config import compute_threads
from specpair.models.loading import is_eagle_checkpoint
from specpair.models.tiny import make_tiny_llama
from specpair.proto.v1 import target_pb2
from specpair.runtime.build import build_drafter, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.state import build_states
from specpair.serving import compute_executor


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (16 + 8 * i,), generator=gen).tolist() for i in range(n)]


def in_process(target: Path, draft: Path, work: list[list[int]], tokens: int, tier: int) -> dict:
    worker = build_target(target, max_requests=len(work), max_len=1024, keep_features=True)
    drafter = build_drafter(draft, target_path=target, max_requests=len(work), max_len=1024)
    engine = SpeculativeEngine(worker, drafter)
    state = build_states([tier])[tier]
    engine.generate(work, max_new_tokens=8, state=state)  # warm-up
    engine.times.per_round.clear()
    t0 = time.perf_counter()
    results = engine.generate(work, max_new_tokens=tokens, state=state)
    wall = time.perf_counter() - t0
    rounds = engine.times.per_round
    return {
        "outputs": [r.token_ids for r in results],
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "stages_ms": {
            "draft": [1e3 * d for d, _, _ in rounds],
            "verify": [1e3 * v for _, v, _ in rounds],
            "schedule": [1e3 * a for _, _, a in rounds],
            "total": [1e3 * (d + v + a) for d, v, a in rounds],
        },
    }


def two_services(
    target: Path, draft: Path, work: list[list[int]], tokens: int, tier: int, threads: int
) -> dict:
    kind = "eagle" if is_eagle_checkpoint(draft) else "model"
    with tempfile.TemporaryDirectory() as logs, ServiceGroup(
        target=target, draft=draft, log_dir=Path(logs), initial_steps=tier, draft_kind=kind,
        threads=threads,
    ) as group:  # fmt: skip
        client = SpecpairClient(group.target, timeout=600)
        while client.server_info()["draft_connection_state"] != "DRAFT_CONNECTION_STATE_CONNECTED":
            time.sleep(0.1)
        client.generate(work[0], max_tokens=8)  # warm-up
        rounds: list[target_pb2.RoundStats] = []
        call = watch_rounds(group.target, rounds)
        time.sleep(0.5)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(work)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=tokens), work))
        wall = time.perf_counter() - t0
        time.sleep(0.3)
        call.cancel()
    spec = [r.timings for r in rounds if r.speculative]
    return {
        "outputs": [list(r.token_ids) for r in results],
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "plain_rounds": sum(not r.speculative for r in rounds),
        "stages_ms": {
            "draft": [t.draft_ms for t in spec],
            "verify": [t.verify_ms for t in spec],
            "rpc": [t.rpc_ms for t in spec],
            "schedule": [t.schedule_ms for t in spec],
            "total": [t.total_ms for t in spec],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, help="target checkpoint (default: generated)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (default: generated)")
    parser.add_argument("--tier", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (0: half the cores)"
    )
    add_output_args(parser, "bench/out/round_overhead.json")
    args = parser.parse_args()
    threads = compute_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="specpair-bench-"))
    target = args.target or make_tiny_llama(
        tmp / "target", seed=1, vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8,
        num_kv_heads=4, intermediate_size=1408, tokenizer=False,
    )  # fmt: skip
    draft = args.draft or make_tiny_llama(
        tmp / "draft", seed=2, vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, intermediate_size=352, tokenizer=False,
    )  # fmt: skip
    from specpair.models.loading import read_args

    work = prompts(args.batch, read_args(target).vocab_size)
    info = device_info()
    print(f"device: {info}", flush=True)
    # Same intra-op threads in both, from a worker thread as the services run their compute.
    with compute_executor("bench-compute", threads) as pool:
        local = pool.submit(in_process, target, draft, work, args.new_tokens, args.tier).result()
    remote = two_services(target, draft, work, args.new_tokens, args.tier, threads)
    lossless = local["outputs"] == remote["outputs"]
    rows: list[list[str]] = []
    for stage in ("draft", "verify", "rpc", "schedule", "total"):
        cells = [stage]
        for run in (local, remote):
            values: list[float] = run["stages_ms"].get(stage, [])
            cells += (
                [f"{percentile(values, 50):.2f}", f"{percentile(values, 99):.2f}"]
                if values
                else ["-", "-"]
            )
        rows.append(cells)
    p50_local = percentile(local["stages_ms"]["total"], 50)
    p50_remote = percentile(remote["stages_ms"]["total"], 50)
    result: dict[str, Any] = {
        "device": info, "tier": args.tier, "batch": args.batch, "new_tokens": args.new_tokens,
        "target": str(target), "draft": str(draft), "in_process": local, "two_services": remote,
        "same_outputs": lossless,
    }  # fmt: skip
    write_json(args.out, result)
    print(
        f"\nround time p50: two services / in-process = {p50_remote / p50_local:.3f}x; "
        f"tokens/s {remote['tokens_per_s']:.1f} vs {local['tokens_per_s']:.1f}; "
        f"same outputs: {'yes' if lossless else 'NO'}; plain rounds: {remote['plain_rounds']}"
    )
    print(f"tier {args.tier}, batch {args.batch}, {args.new_tokens} new tokens, {threads} intra-op "
          f"thread(s) per process, ms per round\n")  # fmt: skip
    print(format_table(
        ["stage", "in-proc p50", "in-proc p99", "2-svc p50", "2-svc p99"], rows
    ))  # fmt: skip


if __name__ == "__main__":
    main()
