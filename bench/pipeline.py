"""Pipelined rounds against sequential ones: two services on two GPUs and on one, in process.

The grown pair (`bench/gpu_speedup.py`: an 8B-cost target, its EAGLE head or a 1B-cost draft
LM), held-out code prompts, greedy. In one run, side by side:

- in-process: the engine at each static tier, sequential (draft, then verify, one GPU);
- services, draft and target on two GPUs (`--two-gpus`: draft on cuda:1), pipelined and not;
- services sharing one GPU, pipelined and not;

each at static tiers 1 / 3 / 7 (pinned through the controller) and adaptive (SGLang's rule).
Per services cell, from the target's RoundStats: the hit rate (request-rounds whose tree was
pre-drafted), the mean accept length of pre-drafted vs freshly drafted trees, and the time the
target waited for the draft per round. Every greedy output must equal the in-process target-
only output (`same`). Ratios: tokens/s over in-process sequential speculation at the same tier
(`x seq`), and the services round time over the in-process one (`round x`).

    python -m bench.pipeline --draft-kind eagle --two-gpus [--batches 1 4]
    python -m bench.pipeline --device cpu --shape shipped --requests 2 --new-tokens 8  # smoke

JSON after every cell (`--out`), the table last, `--replot JSON` prints an earlier run's.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_speedup import (
    TIERS,
    WARMUP_TOKENS,
    Cell,
    add_pair_args,
    bench_pair,
    in_process,
    make_workloads,
)
from bench.services import BenchServices, wait_draft_connected, watch_rounds
from controller.policy import PolicyConfig
from specpair.client import ControllerClient, SpecpairClient
from specpair.config import compute_threads
from specpair.runtime.round import RoundStats
from specpair.serving import compute_executor
from target_service.special_tokens import eos_ids


@dataclass
class Pipelined:
    """A services cell's pipeline account, from its RoundStats."""

    hit_rate: float | None  # pre-drafted request-rounds / pipelined request-rounds
    accept_predrafted: float | None
    accept_fresh: float | None
    wait_ms: float  # mean per round: the target waited for the draft's messages
    round_ms: float  # mean total per speculative round
    verify_ms: float  # mean per round, the target's verify (wall)
    predraft_ms: float  # mean per pipelined round, the draft's pre-draft


def account(rounds: list[RoundStats]) -> Pipelined:
    spec = [r for r in rounds if r.speculative]
    hits = sum(sum(r.predrafted) for r in spec)
    misses = sum(r.predraft_misses for r in spec)
    # an unpipelined round's trees were all drafted fresh (its `predrafted` is empty)
    flags = [list(r.predrafted) or [False] * len(r.accept_lengths) for r in spec]
    pairs = [
        pf for r, f in zip(spec, flags, strict=True) for pf in zip(r.accept_lengths, f, strict=True)
    ]
    pre = [a for a, p in pairs if p]
    fresh = [a for a, p in pairs if not p]
    n = max(len(spec), 1)
    return Pipelined(
        hits / (hits + misses) if hits + misses else None,
        sum(pre) / len(pre) if pre else None,
        sum(fresh) / len(fresh) if fresh else None,
        sum(r.timings.wait_ms for r in spec) / n,
        sum(r.timings.total_ms for r in spec) / n,
        sum(r.timings.verify_ms for r in spec) / n,
        sum(r.timings.predraft_ms for r in spec) / n,
    )


def serve(
    client: SpecpairClient, target: str, deployment: str, config: str, ids: list[list[int]],
    batch: int, new_tokens: int,
) -> tuple[Cell, Pipelined]:  # fmt: skip
    rounds: list[RoundStats] = []
    call = watch_rounds(target, rounds)
    time.sleep(0.2)

    def one(i: int) -> Any:
        return client.generate(ids[i], max_tokens=new_tokens, temperature=0.0, seed=i)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(one, range(len(ids))))
    seconds = time.perf_counter() - t0
    time.sleep(0.2)
    call.cancel()
    outputs = [list(r.token_ids) for r in results]
    accepts = [a for r in rounds for a in r.accept_lengths]
    mean = sum(accepts) / len(accepts) if accepts else None
    cell = Cell(deployment, config, "code greedy", batch, sum(map(len, outputs)), seconds, mean,
                len(accepts), outputs)  # fmt: skip
    return cell, account(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--two-gpus", action="store_true", help="also the draft on cuda:1")
    parser.add_argument("--in-process-only", action="store_true", help="no services cells")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--width", type=int, default=16, help="pre-drafts per round (draft)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="JSON (default: bench/results/pipeline_<kind>)")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only print a run's table")
    args = parser.parse_args()
    if args.replot:
        print(render(__import__("json").loads(args.replot.read_text())["cells"]))
        return
    from transformers import AutoTokenizer

    out = args.out or Path(f"bench/results/pipeline_{args.draft_kind}.json")
    log_dir = out.parent / f"{out.stem}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    info = device_info()
    print(f"device: {info}", flush=True)
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    (workload,) = make_workloads(tokenizer, args.requests, [0.0])[:1]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    max_len = max(256, max(len(p) for p in workload.ids) + args.new_tokens + 16)
    rows: list[dict[str, Any]] = []

    def record(cell: Cell, piped: Pipelined | None = None) -> None:
        rows.append(asdict(cell) | {"tokens_per_s": cell.tokens_per_s} | asdict(piped or _none()))
        print(f"  {cell.deployment:18s} {cell.config:10s} batch {cell.batch:2d} "
              f"{cell.tokens_per_s:8.1f} tok/s", flush=True)  # fmt: skip
        finish(rows)
        write_json(out, {"device": info, "draft_kind": args.draft_kind, "shape": args.shape,
                         "width": args.width,
                         "new_tokens": args.new_tokens, "requests": args.requests,
                         "date": time.strftime("%Y-%m-%d"),
                         "cells": [{k: v for k, v in r.items() if k != "outputs"}
                                   for r in rows]})  # fmt: skip

    print("in-process (sequential)", flush=True)
    with compute_executor("bench-compute", compute_threads(0)) as pool:
        pool.submit(
            in_process, target, draft, [workload], args.batches, new_tokens=args.new_tokens,
            device=args.device, dtype=getattr(torch, dtype), max_len=max_len,
            eos=eos_ids(target, tokenizer), record=record, pipeline_width=args.width,
        ).result()  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    placements = [] if args.in_process_only else [("1 GPU", args.device)]
    if args.two_gpus and not args.in_process_only:
        placements.insert(0, ("2 GPUs", "cuda:1"))
    policy = PolicyConfig(candidate_steps=TIERS).to_dict()
    for where, draft_device in placements:
        for pipeline in ("on", "off"):
            deployment = f"svc {where} {'pipe' if pipeline == 'on' else 'seq'}"
            print(deployment, flush=True)
            with BenchServices(
                target=target, draft=draft, draft_kind=args.draft_kind, log_dir=log_dir,
                policy=policy, device=args.device, draft_device=draft_device, dtype=dtype,
                max_len=max_len, candidate_steps=TIERS, pipeline=pipeline,
                draft_options=("--pipeline-width", str(args.width)),
            ) as group:  # fmt: skip
                client = SpecpairClient(group.target, timeout=600)
                wait_draft_connected(client)
                client.generate(workload.ids[0], max_tokens=WARMUP_TOKENS)
                ctl = ControllerClient(group.controller, timeout=30)
                for config in [f"tier {t}" for t in TIERS] + ["adaptive"]:
                    if config == "adaptive":
                        ctl.unpin()
                    else:
                        ctl.pin(int(config.split()[1]))
                    time.sleep(0.3)
                    for batch in args.batches:
                        record(*serve(client, group.target, deployment, config, workload.ids,
                                      batch, args.new_tokens))  # fmt: skip
    print(render(rows))


def _none() -> Pipelined:
    return Pipelined(None, None, None, 0.0, 0.0, 0.0, 0.0)


def finish(rows: list[dict[str, Any]]) -> None:
    """Ratios over the in-process cell of the same tier and batch; outputs vs target-only."""
    base = {(r["config"], r["batch"]): r for r in rows if r["deployment"] == "in-process"}
    plain = {r["batch"]: r for r in rows if r["config"] == "target-only"}
    for r in rows:
        if r["deployment"] == "in-process" and (s := r.get("stage_ms")):
            r["verify_ms"], r["predraft_ms"] = s["verify"], s.get("predraft", 0.0)
            r["hit_rate"] = s.get("hit_rate")
        ref = base.get((r["config"], r["batch"])) or base.get(("tier 3", r["batch"]))
        if ref is not None and r["deployment"] != "in-process":
            r["x_seq"] = r["tokens_per_s"] / ref["tokens_per_s"]
            if r.get("round_ms") and ref.get("stage_ms"):
                s = ref["stage_ms"]
                r["round_x"] = r["round_ms"] / (s["draft"] + s["verify"] + s["accept"])
        if (p := plain.get(r["batch"])) is not None and "outputs" in r:
            r["same"] = r["outputs"] == p["outputs"]


def render(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    table = [
        [r["deployment"], r["config"], str(r["batch"]), f"{r['tokens_per_s']:.1f}",
         f(r.get("accept_mean"), ".2f"), f(r.get("x_seq"), ".3f"), f(r.get("round_x"), ".3f"),
         f(r.get("hit_rate"), ".2f"), f(r.get("accept_predrafted"), ".2f"),
         f(r.get("accept_fresh"), ".2f"), f(r.get("wait_ms") or None, ".2f"),
         f(r.get("verify_ms") or None, ".2f"), f(r.get("predraft_ms") or None, ".2f"),
         {True: "yes", False: "NO", None: "-"}[r.get("same")]]
        for r in rows
    ]  # fmt: skip
    head = ["deployment", "config", "batch", "tok/s", "accept", "x seq", "round x", "hits",
            "acc pre", "acc fresh", "wait ms", "verify ms", "pre ms", "same"]  # fmt: skip
    return format_table(head, table)


if __name__ == "__main__":
    main()
