"""What a round costs besides the GPU: the two services against the in-process engine, per stage
(the default mode), and the target's host work on a sampled round's trees without any model.

    python -m bench.round_overhead [services] [--device cuda] [--tiers 1 3 7] [--batch 1]
    python -m bench.round_overhead host [--batches 1 8 16] [--tiers 3 7] [--iters 200]

`python -m bench.round_overhead MODE -h` gives a mode's options. `host` was bench/host_round.py
(git history). The transport floor under the rpc share: bench/grpc_pingpong.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from bench import common
from bench.checkpoints import random_pair
from bench.common import (
    add_output_args,
    device_info,
    format_table,
    median,
    percentile,
    shape_arg,
    write_json,
)
from bench.gpu_common import LLAMA3_8B
from bench.prompts import code_prompts
from bench.services import (
    LINKS,
    BenchServices,
    apply_tier,
    rounds_watched,
    wait_draft_connected,
)
from specpair.client import SpecpairClient
from specpair.config import CANDIDATE_STEPS, compute_threads
from specpair.models.loading import is_eagle_checkpoint, read_args
from specpair.models.tiny import make_tiny_llama
from specpair.proto.v1 import draft_pb2
from specpair.rpc import wire
from specpair.rpc.serving import compute_executor
from specpair.runtime.accept import greedy_path
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import GREEDY, SpeculativeEngine
from specpair.runtime.round_messages import RoundResponse, RoundStats
from specpair.runtime.sampling import DRAFT_SUPPORT, SamplingParams, make_generator
from specpair.runtime.shape import TreeShape
from specpair.runtime.target.accepting import accept_greedy_batch, chain_inputs
from specpair.runtime.tree import CandidateTree, chain, sparse_q_faults, validate_tree

# --- services (was bench/round_overhead.py) ---

SERVICES_DOC = """\
Per-round cost of the two-service deployment vs the in-process engine, same models, per tier.

Both run the same greedy workload (a batch of concurrent requests at a fixed tier: a chain "7"
or a tree "5x4x20", STEPSxTOPKxNUM_DRAFT_TOKENS). In-process rounds split into draft / verify /
accept bookkeeping; service rounds, as the target reports them on WatchRounds, into draft (the
draft's own compute) / draft_host (the draft service's event loop and thread hand-offs around
it) / verify / serialization + gRPC (round trip minus the draft service's time) / scheduling
(admission, bookkeeping, streaming). One service group serves every tier (the trees built with
`--tree-shapes`), pinned in turn with ApplyTier (no controller).

    python -m bench.round_overhead [--target models/target --draft models/draft] [--tiers 3]
    python -m bench.round_overhead --device cuda --shape llama3-8b --tiers 1 3 7 5x4x20 \\
        [--draft-device cuda:1] [--models-dir /tmp/llama3-8b] [--links tcp unix]

`--links tcp unix` runs the services twice against the same in-process run: the target reaches
the draft over loopback TCP, then over a Unix domain socket.

`--shape llama3-8b` writes a random bf16 Llama-3-8B and an EAGLE head for it (16 GB) first.
"""


STAGES = ("draft", "draft_gpu", "draft_host", "verify", "verify_gpu", "rpc", "schedule", "total")


WARMUP_TOKENS = 8


def prompts(n: int, vocab: int, length: int | None = None, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of `length` tokens (None: 16, 24, 32, … as on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [length or 16 + 8 * i for i in range(n)]
    return [torch.randint(1, vocab, (size,), generator=gen).tolist() for size in sizes]


def in_process(
    target: Path,
    draft: Path,
    work: list[list[int]],
    tokens: int,
    tiers: list[TreeShape],
    *,
    device: str,
    dtype: torch.dtype,
    max_len: int,
    sampling: SamplingParams = GREEDY,
) -> dict[TreeShape, dict]:
    """One engine; every tier's state (and, on a GPU, graphs) built up front, as the services do."""
    worker = build_target(
        target, max_requests=len(work), max_len=max_len, keep_features=True, dtype=dtype,
        device=device, feature_layers=feature_layers(draft, target),
    )  # fmt: skip
    drafter = build_drafter(
        draft, target_path=target, max_requests=len(work), max_len=max_len, dtype=dtype,
        device=device,
    )  # fmt: skip
    engine = SpeculativeEngine(worker, drafter)
    states = build_states(tiers, worker, drafter)
    runs = {}
    seeded = [replace(sampling, seed=i) for i in range(len(work))]
    for tier in tiers:
        engine.generate(work, max_new_tokens=WARMUP_TOKENS, state=states[tier], sampling=seeded)
        engine.times.per_round.clear()
        engine.times.gpu_ms.clear()
        t0 = time.perf_counter()
        results = engine.generate(work, max_new_tokens=tokens, state=states[tier], sampling=seeded)
        wall = time.perf_counter() - t0
        rounds = engine.times.per_round
        runs[tier] = {
            "outputs": [r.token_ids for r in results],
            "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
            "stages_ms": {
                "draft": [1e3 * d for d, _, _ in rounds],
                "draft_gpu": [d for d, _ in engine.times.gpu_ms],
                "verify": [1e3 * v for _, v, _ in rounds],
                "verify_gpu": [v for _, v in engine.times.gpu_ms],
                "schedule": [1e3 * a for _, _, a in rounds],
                "total": [1e3 * (d + v + a) for d, v, a in rounds],
            },
        }
    return runs


def two_services(
    target: Path,
    draft: Path,
    work: list[list[int]],
    tokens: int,
    tiers: list[TreeShape],
    *,
    threads: int,
    device: str,
    draft_device: str,
    dtype: str,
    max_len: int,
    log_dir: Path,
    busy_poll_ms: float | None,
    cpus: dict[str, set[int]] | None = None,
    link: str = "tcp",
    sampling: SamplingParams = GREEDY,
) -> dict[TreeShape, dict]:
    """Both services built with every tier of `tiers` (the trees through `--tree-shapes`,
    starting at the first), each pinned in turn by ApplyTier."""
    kind = "eagle" if is_eagle_checkpoint(draft) else "model"
    chains = {t.steps for t in tiers if t.is_chain}
    trees = tuple(arg for t in tiers if not t.is_chain for arg in ("--tree-shapes", str(t)))
    first = () if tiers[0].is_chain else ("--initial-shape", str(tiers[0]))
    with BenchServices(
        target=target, draft=draft, log_dir=log_dir, initial_steps=tiers[0].steps,
        draft_kind=kind, threads=threads, device=device, draft_device=draft_device, dtype=dtype,
        max_len=max_len, candidate_steps=sorted(set(CANDIDATE_STEPS) | chains),
        busy_poll_ms=busy_poll_ms, cpus=cpus, link=link, draft_options=trees,
        target_options=(*trees, *first),
    ) as group:  # fmt: skip
        client = SpecpairClient(group.target, timeout=600)
        wait_draft_connected(client)
        runs = {}
        with ThreadPoolExecutor(len(work)) as pool:

            def one(i: int, max_tokens: int) -> Any:
                return client.generate(
                    work[i], max_tokens=max_tokens, temperature=sampling.temperature,
                    top_p=sampling.top_p, seed=i,
                )  # fmt: skip

            def generate(max_tokens: int) -> list[Any]:
                return list(pool.map(lambda i: one(i, max_tokens), range(len(work))))

            for tier in tiers:
                apply_tier(group.target, tier)
                generate(WARMUP_TOKENS)
                rounds: list[RoundStats] = []
                with rounds_watched(group.target, rounds, before_s=0.5, after_s=0.3):
                    t0 = time.perf_counter()
                    results = generate(tokens)
                    wall = time.perf_counter() - t0
                runs[tier] = service_run(results, rounds, tier, wall)
    return runs


def service_run(
    results: list[Any], rounds: list[RoundStats], tier: TreeShape, wall: float
) -> dict[str, Any]:
    spec = [r.timings for r in rounds if r.speculative and r.tier == tier]
    return {
        "outputs": [list(r.token_ids) for r in results],
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "plain_rounds": sum(not r.speculative for r in rounds),
        "stages_ms": {
            "draft": [t.draft_ms for t in spec],
            "draft_gpu": [t.draft_gpu_ms for t in spec],
            "draft_host": [t.draft_host_ms for t in spec],
            "verify": [t.verify_ms for t in spec],
            "verify_gpu": [t.verify_gpu_ms for t in spec],
            "rpc": [t.rpc_ms for t in spec],
            "schedule": [t.schedule_ms for t in spec],
            "total": [t.total_ms for t in spec],
        },
    }


def table_rows(tier: TreeShape, local: dict, remote: dict) -> list[list[str]]:
    """One row per stage: p50/p99 of each, and two services / in-process at p50. The GPU-time
    rows only where graphs ran (not on the CPU)."""
    rows = []
    for stage in STAGES:
        if stage.endswith("_gpu") and not any(local["stages_ms"].get(stage, [])):
            continue
        cells = [f"{tier} {stage}"]
        p50s = []
        for side in (local, remote):
            values: list[float] = side["stages_ms"].get(stage, [])
            p50s.append(percentile(values, 50) if values else None)
            cells += (
                [f"{percentile(values, 50):.2f}", f"{percentile(values, 99):.2f}"]
                if values
                else ["-", "-"]
            )
        a, b = p50s
        cells.append(f"{b / a:.3f}x" if a and b is not None else "-")
        rows.append(cells)
    return rows


def headroom(tiers: list[TreeShape]) -> int:
    """Cache positions a round needs past a request's tokens: the verified root and nodes, or the
    draft's tentative rows where more (a chain of s: s + 1; 6x8x32: 40)."""
    return max(max(t.verified, t.draft_headroom) for t in tiers)


def same_device(a: str, b: str) -> bool:
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.round_overhead services",
        description=SERVICES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", type=Path, help="target checkpoint (default: generated)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (default: generated)")
    parser.add_argument(
        "--shape", choices=["tiny", "llama3-8b"], default="tiny",
        help="generated pair: tiny target + LM draft (CPU), or Llama-3-8B + EAGLE head (bf16)",
    )  # fmt: skip
    parser.add_argument(
        "--models-dir", type=Path,
        help="where generated checkpoints go, kept and reused (default: a temp dir, removed)",
    )  # fmt: skip
    parser.add_argument(
        "--tiers", "--tier", type=shape_arg, nargs="+", default=[TreeShape(3)], metavar="TIER",
        help="chains (STEPS: 1 3 7) and trees (STEPSxTOPKxNUM_DRAFT_TOKENS: 5x4x20)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--prompt-len", type=int, help="tokens per prompt (default: 16, 24, … tiny; 512 llama3-8b)"
    )
    parser.add_argument(
        "--prompts",
        choices=["random", "code"],
        default="random",
        help="random tokens (--prompt-len), or held-out code (a checkpoint with a tokenizer)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (in-process, target)")
    parser.add_argument("--draft-device", help="the draft service's device (default: --device)")
    parser.add_argument("--dtype", help="float32 (CPU default) | bfloat16 (GPU default)")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (0: half the cores)"
    )
    parser.add_argument(
        "--busy-poll-ms", type=float, help="the services' busy_poll_ms lab switch (default: theirs)"
    )
    parser.add_argument(
        "--links", nargs="+", choices=LINKS, default=["tcp"],
        help="the target-draft wire of the two-service runs, one run each: loopback tcp, unix",
    )  # fmt: skip
    parser.add_argument(
        "--pin-cpus", nargs=3, type=common.cpu_list, metavar=("IN_PROCESS", "DRAFT", "TARGET"),
        help="CPU lists (e.g. 0-3 4-7 8-11) for the in-process run and each service",
    )  # fmt: skip
    add_output_args(parser, "bench/out/round_overhead.json")
    return parser


def services_main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    draft_device = args.draft_device or args.device
    for dev in {args.device, draft_device}:
        index = torch.device(dev).index or 0
        if dev.startswith("cuda") and index >= torch.cuda.device_count():
            parser.error(f"{dev}: {torch.cuda.device_count()} CUDA device(s) here")
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    tiers = sorted(set(args.tiers))
    threads = compute_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="specpair-bench-") as tmp:
        root = args.models_dir or Path(tmp)
        target, draft = args.target, args.draft
        if args.shape == "llama3-8b" and not (target and draft):
            print(f"writing a random Llama-3-8B + EAGLE head (bf16, 16 GB) to {root}", flush=True)
            pair = random_pair(
                root, LLAMA3_8B, device=args.device, progress=lambda m: print(f"  {m}", flush=True)
            )
            target, draft = target or pair[0], draft or pair[1]
        target = target or make_tiny_llama(
            root / "target", seed=1, vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8,
            num_kv_heads=4, intermediate_size=1408, tokenizer=False,
        )  # fmt: skip
        draft = draft or make_tiny_llama(
            root / "draft", seed=2, vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, intermediate_size=352, tokenizer=False,
        )  # fmt: skip
        prompt_len = args.prompt_len or (512 if args.shape == "llama3-8b" else None)
        if args.prompts == "code":  # real acceptance: held-out code windows of 96-128 tokens
            tokenizer = AutoTokenizer.from_pretrained(target)
            work = [p.ids for p in code_prompts(tokenizer, args.batch, 96, 128)]
        else:
            work = prompts(args.batch, read_args(target).vocab_size, prompt_len)
        context = max(1024, max(map(len, work)) + args.new_tokens)
        compare(args, target, draft, work, tiers, threads, draft_device, dtype_name, context)


def compare(
    args: argparse.Namespace,
    target: Path,
    draft: Path,
    work: list[list[int]],
    tiers: list[TreeShape],
    threads: int,
    draft_device: str,
    dtype_name: str,
    context: int,
) -> None:
    info = device_info()
    print(f"device: {info}", flush=True)
    cpus = None
    if args.pin_cpus:
        mine, draft_cpus, target_cpus = args.pin_cpus
        os.sched_setaffinity(0, mine)  # this thread and the compute thread it starts
        cpus = {"draft": draft_cpus, "target": target_cpus}
        print(f"pinned: in-process {sorted(mine)}, draft {sorted(draft_cpus)}, target "
              f"{sorted(target_cpus)}", flush=True)  # fmt: skip
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    # Same intra-op threads in both, from a worker thread as the services run their compute.
    with compute_executor("bench-compute", threads) as pool:
        local = pool.submit(
            in_process, target, draft, work, args.new_tokens, tiers, device=args.device,
            dtype=getattr(torch, dtype_name), max_len=context + headroom(tiers), sampling=sampling,
        ).result()  # fmt: skip
    if torch.cuda.is_available():  # the in-process models leave the GPU to the services
        gc.collect()
        torch.cuda.empty_cache()
    log_dir = args.out.parent / f"{args.out.stem}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("*.log"):
        old.unlink()
    remote = {}  # link -> tier -> run
    for link in args.links:
        remote[link] = two_services(
            target, draft, work, args.new_tokens, tiers, threads=threads, device=args.device,
            draft_device=draft_device, dtype=dtype_name, max_len=context, log_dir=log_dir,
            busy_poll_ms=args.busy_poll_ms, cpus=cpus, link=link, sampling=sampling,
        )  # fmt: skip
    if args.device == "cpu":
        mode = "two services, CPU"
    elif same_device(args.device, draft_device):
        mode = "two services, same GPU"
    else:
        mode = "two services, one GPU each"
    per_tier: dict[str, dict[str, Any]] = {}  # "3", "5x4x20": JSON keys
    rows: dict[str, list[list[str]]] = {link: [] for link in args.links}
    for tier in tiers:
        p50_local = percentile(local[tier]["stages_ms"]["total"], 50)
        links = {}
        for link, runs in remote.items():
            links[link] = {
                "two_services": runs[tier],
                "same_outputs": local[tier]["outputs"] == runs[tier]["outputs"],
                "total_p50_ratio": percentile(runs[tier]["stages_ms"]["total"], 50) / p50_local,
            }
            rows[link] += table_rows(tier, local[tier], runs[tier])
        first = links[args.links[0]]
        per_tier[str(tier)] = {"in_process": local[tier], **first, "links": links}
    result: dict[str, Any] = {
        "device": info, "mode": mode, "target_device": args.device, "draft_device": draft_device,
        "dtype": dtype_name, "shape": args.shape, "tiers": per_tier, "batch": args.batch,
        "new_tokens": args.new_tokens, "prompt_lens": [len(p) for p in work], "threads": threads,
        "target": str(target), "draft": str(draft), "service_logs": str(log_dir),
        "busy_poll_ms": args.busy_poll_ms, "links": args.links,
        "pinned_cpus": None if cpus is None else {k: sorted(v) for k, v in cpus.items()},
    }  # fmt: skip
    write_json(args.out, result)
    print(f"\n{mode} vs in-process on {args.device} ({dtype_name}); batch {args.batch}, "
          f"{args.new_tokens} new tokens, prompts of {len(work[0])}+ tokens, {threads} intra-op "
          f"thread(s) per process, services' busy_poll_ms "
          f"{'default' if args.busy_poll_ms is None else args.busy_poll_ms}")  # fmt: skip
    for name, r in per_tier.items():
        for link, lr in r["links"].items():
            print(
                f"tier {name}, {link}: round time p50 two services / in-process = "
                f"{lr['total_p50_ratio']:.3f}x (goal <= 1.05); tokens/s "
                f"{lr['two_services']['tokens_per_s']:.1f} vs "
                f"{r['in_process']['tokens_per_s']:.1f}; "
                f"same outputs: {'yes' if lr['same_outputs'] else 'NO'}; "
                f"plain rounds: {lr['two_services']['plain_rounds']}"
            )
    headers = ["tier stage", "in-proc p50", "in-proc p99", "2-svc p50", "2-svc p99", "2-svc/in"]
    for link in args.links:
        print(f"\nms per round, two services over {link}\n")
        print(format_table(headers, rows[link]))


# --- host (was bench/host_round.py) ---

HOST_DOC = """\
The target's host work on a sampled round's trees, without any model: what the services pay
per round besides the GPU, by batch and tier, over a Llama-3 vocabulary.

Per round of B sampled chains of s drafts, each with a 64-token q (as the draft sends them: the
round's q in two tensors; beside it, each tree's own, as before them),
median µs of: the draft's `RoundResponse` encoded, the target decoding it, checking the trees
(`validate_tree`, then the round's sparse qs at once; beside it, each tree's alone), and
`chain_inputs` (uniforms, drafts, q for the accept); and the message's bytes. Beside them, a
greedy round's accept from the target's argmax (`accept_greedy_batch`; beside it, a row read
and the tree's children walked per request).

    python -m bench.round_overhead host [--batches 1 8 16] [--tiers 3 7] [--iters 200]
"""


VOCAB = 128256


class Sampled:
    """What `chain_inputs` reads of a request."""

    def __init__(self, seed: int) -> None:
        self.sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=seed)
        self.generator = make_generator(seed)


def sampled_chain(s: int, gen: torch.Generator) -> CandidateTree:
    """A chain of s drafts, each drawn from its own 64-token q (the draft is its first id)."""
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:DRAFT_SUPPORT] for _ in range(s)])
    q = torch.softmax(torch.randn(s, DRAFT_SUPPORT, generator=gen), -1)
    return chain(ids[:, 0].tolist(), q, ids.int())


def median_us(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * median(times)


def measure(batch: int, s: int, iters: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(batch * 100 + s)
    trees = {f"r{i}": sampled_chain(s, gen) for i in range(batch)}
    response = RoundResponse(round_id=1, trees=trees)
    data = wire.response_to_proto(response).SerializeToString()
    per_tree = wire.response_to_proto(response, round_q=False).SerializeToString()
    seqs = [Sampled(i) for i in range(batch)]
    # greedy chains whose argmax rows accept a random prefix of each
    greedy = [chain(torch.randint(0, VOCAB, (s,), generator=gen).tolist()) for _ in range(batch)]
    argmax = torch.randint(0, VOCAB, (batch, s + 1), generator=gen)
    for i, tree in enumerate(greedy):
        m = int(torch.randint(0, s + 1, (1,), generator=gen))
        argmax[i, :m] = torch.tensor(tree.tokens[:m], dtype=torch.long)

    def check() -> None:  # as served: structure per tree, then the round's sparse qs at once
        for tree in trees.values():
            validate_tree(tree, max_nodes=64, max_depth=s, vocab_size=VOCAB, sparse_q=False)
        assert not any(sparse_q_faults(list(trees.values()), VOCAB))

    def check_alone() -> None:  # each tree's sparse q on its own
        for tree in trees.values():
            validate_tree(tree, max_nodes=64, max_depth=s, vocab_size=VOCAB)

    return {
        "bytes": float(len(data)),
        "encode": median_us(lambda: wire.response_to_proto(response).SerializeToString(), iters),
        "decode": median_us(
            lambda: wire.response_from_proto(draft_pb2.RoundResponse.FromString(data)), iters
        ),
        "encode_per_tree": median_us(
            lambda: wire.response_to_proto(response, round_q=False).SerializeToString(), iters
        ),
        "decode_per_tree": median_us(
            lambda: wire.response_from_proto(draft_pb2.RoundResponse.FromString(per_tree)), iters
        ),
        "check": median_us(check, iters),
        "check_alone": median_us(check_alone, iters),
        "chain_inputs": median_us(lambda: chain_inputs(seqs, list(trees.values()), s + 1), iters),
        "greedy_accept": median_us(lambda: accept_greedy_batch(greedy, argmax), iters),
        "greedy_accept_per_row": median_us(
            lambda: [
                greedy_path(t, argmax[i, : len(t) + 1].tolist()) for i, t in enumerate(greedy)
            ],
            iters,
        ),
    }


def host_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.round_overhead host",
        description=HOST_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--tiers", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--iters", type=int, default=200)
    add_output_args(parser, "bench/out/host_round.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as a service's event loop runs it
    cells = [
        {"batch": b, "tier": s, **measure(b, s, args.iters)}
        for s in args.tiers
        for b in args.batches
    ]
    write_json(Path(args.out), {"device": device_info(), "vocab": VOCAB, "cells": cells})
    keys = ["encode", "decode", "check", "chain_inputs"]
    rows = [
        [
            str(c["batch"]),
            str(c["tier"]),
            f"{c['bytes'] / 1024:.1f}",
            *(f"{c[k]:.0f}" for k in keys),
            f"{sum(c[k] for k in keys):.0f}",
            f"{c['check_alone']:.0f}",
            f"{c['encode_per_tree']:.0f} / {c['decode_per_tree']:.0f}",
            f"{c['greedy_accept']:.0f} / {c['greedy_accept_per_row']:.0f}",
        ]
        for c in cells
    ]
    headers = ["batch", "tier", "KB", *(f"{k} us" for k in keys), "total us"]
    headers += ["check alone us", "q per tree: encode / decode us"]
    headers += ["greedy accept: batch / per row us"]
    print(format_table(headers, rows))


MODES = {
    "services": services_main,
    "host": host_main,
}


def main(argv: list[str] | None = None) -> None:
    """`MODE [options]`; without a mode, services's options."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    mode = args.pop(0) if args and args[0] in MODES else "services"
    MODES[mode](args)


if __name__ == "__main__":
    main()
