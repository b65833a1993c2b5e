"""The round on one GPU, in process: the 8B target's rounds with a draft, by stage (random weights).

    python -m bench.gpu_rounds [rounds] [--drafts none eagle 1b] [--rounds 30]
    python -m bench.gpu_rounds profile [--ctx 512]     kernel time per verify replay
    python -m bench.gpu_rounds host [--tier 3]         host time around the graphs
    python -m bench.gpu_rounds tier-switch             a tier switch and its first round
    python -m bench.gpu_rounds batch [--rounds 12]     tokens/s by batch, draft = target
    python -m bench.gpu_rounds handoff [--prompts 64]  a prompt hand-off on the draft, by part

`python -m bench.gpu_rounds MODE -h` gives a mode's options. Before they were one entry point
the modes were bench/gpu_rounds.py, gpu_profile.py, gpu_host.py, gpu_tier_switch.py and
gpu_batch.py (git history). Two services instead of in process: bench/round_overhead.py.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.common import device_info, format_table, median, write_json
from bench.gpu_common import (
    LLAMA3_8B,
    RoundLoop,
    build_pair,
    copy_bandwidth,
    pair_workers,
    random_llama,
    run_rounds,
    time_cuda,
)
from specpair.runtime.build import StateBuilder
from specpair.runtime.gpu.capture import GraphCapture, pad_layout
from specpair.runtime.gpu.fused import fuse_decoder
from specpair.runtime.gpu.verify_graphs import verify_graph
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.state import gpu_ms

# --- rounds (was bench/gpu_rounds.py) ---

ROUNDS_DOC = """\
Round time per tier (1, 3, 7) for the 8B target with realistic drafts, split by stage.

    python -m bench.gpu_rounds [rounds] [--rounds 30] [--out FILE.json]

Drafts: an EAGLE head at hidden 4096 (one decoder layer + fc, the target's embedding and LM
head) and a ~1.2B standalone LM. Random weights: acceptance is ~0, so each round extends the
draft by one token (the bonus); stage costs are what matter here. In-process only (two
services: bench/round_overhead.py).
"""


def rounds_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_rounds rounds", description=ROUNDS_DOC.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--drafts", nargs="+", default=["none", "eagle", "1b"])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_rounds.json"))
    args = parser.parse_args(argv)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    rows, table = [], []
    prompt = [list(torch.randint(0, 128256, (args.prompt,)).tolist())]
    for draft in args.drafts:
        worker, drafter, states, capture_s = build_pair(draft, 1, [1], tiers, args.prompt + 256)
        for tier in tiers if draft != "none" else [1]:
            t = run_rounds(worker, drafter, states[tier], prompt, args.rounds)
            skip = 2  # first rounds: the draft's eager prompt extend
            ms = {
                k: 1e3 * median(getattr(t, k)[skip:])
                for k in ("extend", "draft", "verify", "other")
            }
            total = 1e3 * median(
                [
                    e + d + v + o
                    for e, d, v, o in zip(
                        t.extend[skip:],
                        t.draft[skip:],
                        t.verify[skip:],
                        t.other[skip:],
                        strict=True,
                    )
                ]
            )
            label = "target only" if draft == "none" else draft
            rows.append(
                {"draft": label, "tier": tier, "capture_s": capture_s, "round_ms": total, **ms}
            )
            table.append(
                [
                    label,
                    "-" if draft == "none" else str(tier),
                    f"{ms['extend']:.2f}",
                    f"{ms['draft']:.2f}",
                    f"{ms['verify']:.2f}",
                    f"{ms['other']:.2f}",
                    f"{total:.2f}",
                    f"{capture_s:.1f}",
                ]
            )
        del worker, drafter, states
        gc.collect()
        torch.cuda.empty_cache()
    write_json(args.out, {"device": info, "rows": rows})
    print(f"\nGPU round time per tier, batch 1, prompt {args.prompt} — {info.get('gpu')}")
    print(
        format_table(
            [
                "draft",
                "tier",
                "extend ms",
                "draft ms",
                "verify ms",
                "accept ms",
                "round ms",
                "capture s",
            ],
            table,
        )
    )


# --- profile (was bench/gpu_profile.py) ---

PROFILE_DOC = """\
Where the 8B verify forward's time goes: kernels per replay, idle gaps, GEMM efficiency.

    python -m bench.gpu_rounds profile [--ctx 512] [--queries 1 8] [--batches 1:1 64:47]

1. The verify CUDA graph (a bucket of B requests, R of them q tokens after ctx of context, the
   rest padding rows, as a served batch of R pads to its bucket: `--batches B:R`) under
   `torch.profiler`: kernels grouped by kind (GEMM, attention, Triton elementwise, other),
   GPU-busy time vs replay span (the rest is idle bus between kernels), and the number of
   kernels per replay.
2. Every weight GEMM of the model alone at M = q and B × q rows (`F.linear`, the cuBLAS call the
   layers make), over enough rotating weight copies that L2 never holds one: achieved weight-read
   bandwidth against the device-to-device copy bandwidth (read + write) that defines the floor.
Kernels launch without programmatic dependent launch here, so each one's time is its own.
"""


def kind_of(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("prefill", "decode", "flashinfer", "merge", "attn", "attention")):
        return "attention"
    if any(s in low for s in ("gemm", "gemv", "cutlass", "sm90", "splitk", "xmma", "nvjet")):
        return "gemm"
    if name.startswith("_") and name.endswith("_kernel"):
        return "triton"
    return "other"


def profile_graph(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, Any]:
    """Kernel durations inside `replays` graph replays, per replay."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    per = len(kernels) // replays
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    spans = []
    for r in range(replays):
        chunk = kernels[r * per : (r + 1) * per]
        spans.append(chunk[-1][1] - chunk[0][0])
    for start, end, name in kernels:
        by_name[name] += (end - start) / replays
        counts[name] += 1
    busy = sum(by_name.values())
    kinds: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        kinds[kind_of(name)] += us
    return {
        "kernels_per_replay": per,
        "span_us": median(spans),
        "busy_us": busy,
        "by_kind_us": dict(kinds),
        "by_name": sorted(
            ({"name": n, "us": us, "count": counts[n] // replays} for n, us in by_name.items()),
            key=lambda d: -d["us"],
        ),
    }


def gemm_efficiency(model: Any, q: int, bw: float, pool_bytes: float = 2e9) -> list[dict]:
    """Each distinct weight shape at M = q, timed over rotating copies (no L2 reuse)."""
    layer = model.model.layers[0]
    weights = {
        "qkv": layer.qkv,
        "o": layer.o,
        "gate_up": layer.gate_up,
        "down": layer.down,
        "lm_head": model.lm_head.weight,
    }
    rows = []
    for name, w in weights.items():
        nbytes = w.numel() * w.element_size()
        copies = [w.clone() for _ in range(max(2, int(pool_bytes // nbytes)))]
        x = torch.randn(q, w.shape[1], dtype=w.dtype, device=w.device)

        def sweep(copies: list[torch.Tensor] = copies, x: torch.Tensor = x) -> None:
            for c in copies:
                F.linear(x, c)

        graph = torch.cuda.CUDAGraph()
        sweep()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            sweep()
        t = median(time_cuda(graph.replay, 10)) / len(copies)
        rows.append(
            {
                "weight": name,
                "shape": list(w.shape),
                "q": q,
                "us": 1e6 * t,
                "read_Bps": nbytes / t,
                "of_copy_bw": nbytes / t / bw,
            }
        )
        del copies, graph
        torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def profile_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_rounds profile", description=PROFILE_DOC.splitlines()[0]
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--batches",
        nargs="+",
        default=["1:1"],
        help="graph bucket:requests, e.g. 64:47 (47 requests at ctx, the rest padding rows)",
    )
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_profile.json"))
    args = parser.parse_args(argv)
    batches = [tuple(int(n) for n in b.split(":")) for b in args.batches]
    from specpair.runtime.gpu import triton_kernels  # GPU only

    # Kernel durations, not waits: with PDL a kernel launches early and waits inside.
    triton_kernels.set_pdl(False)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    model = random_llama(LLAMA3_8B)
    fuse_decoder(model)
    most = max(real for _, real in batches)
    cache = KVCache.for_model(
        LLAMA3_8B, max_requests=most, max_len=args.ctx + 16, dtype=torch.bfloat16, device="cuda"
    )
    graphs = GraphCapture(cache, max(bucket for bucket, _ in batches), "target")
    slots = [cache.alloc() for _ in range(most)]
    pos = torch.arange(args.ctx, device="cuda")[None]
    for slot in slots:
        prompt = torch.randint(0, LLAMA3_8B.vocab_size, (1, args.ctx), device="cuda")
        model(prompt, pos, cache.bind(BatchLayout.causal([slot], [0], [args.ctx])))
        cache.commit(slot, 0, range(args.ctx))
    profiles, gemms, table = {}, [], []
    for q in args.queries:
        for bucket, real in batches:
            g = verify_graph(graphs, model, bucket, q)
            mask = torch.ones(q, q, dtype=torch.bool).tril().expand(real, -1, -1)
            layout = BatchLayout(torch.tensor(slots[:real]), torch.full((real,), args.ctx), mask)
            g.attention[0].plan(pad_layout(layout, bucket, q, cache.pad_slot))
            g.inputs["positions"].copy_(torch.arange(args.ctx, args.ctx + q).expand(bucket, q))
            replay = median(time_cuda(g.graph.replay, 30))
            p = profile_graph(g.graph, args.replays)
            p["replay_us"] = 1e6 * replay
            name = f"{q}" if (bucket, real) == (1, 1) else f"{q} @ {bucket}:{real}"
            profiles[name] = p
            print(f"q {name}: replay {1e6 * replay:.0f} us, top kernels:")
            for k in p["by_name"][:12]:
                print(f"  {k['us']:8.1f} us  x{k['count']:<4d} {k['name'][:110]}")
            gaps = p["span_us"] - p["busy_us"]
            kinds = p["by_kind_us"]
            table.append(
                [
                    name,
                    f"{p['replay_us']:.0f}",
                    str(p["kernels_per_replay"]),
                    f"{p['busy_us']:.0f}",
                    f"{gaps:.0f}",
                    f"{kinds.get('gemm', 0):.0f}",
                    f"{kinds.get('attention', 0):.0f}",
                    f"{kinds.get('triton', 0):.0f}",
                    f"{kinds.get('other', 0):.0f}",
                ]
            )
            del g
    for m in sorted({q * bucket for q in args.queries for bucket, _ in batches}):
        gemms += gemm_efficiency(model, m, bw)
    write_json(
        args.out,
        {
            "device": info,
            "copy_bandwidth_Bps": bw,
            "ctx": args.ctx,
            "profiles": profiles,
            "gemms": gemms,
        },
    )
    gpu = info.get("gpu")
    print(f"\nGEMMs alone (F.linear, rotating weights) — {gpu}, copy {bw / 1e12:.2f} TB/s")
    print(
        format_table(
            ["weight", "q", "us", "TB/s", "of copy bw"],
            [
                [
                    r["weight"],
                    str(r["q"]),
                    f"{r['us']:.1f}",
                    f"{r['read_Bps'] / 1e12:.2f}",
                    f"{r['of_copy_bw']:.3f}",
                ]
                for r in gemms
            ],
        )
    )
    print(f"\nVerify graph, ctx {args.ctx}, per replay (us) — {info.get('gpu')}")
    columns = ["q @ bucket:requests", "replay", "kernels", "busy", "gaps", "gemm", "attention"]
    print(format_table([*columns, "triton", "other"], table))


# --- host (was bench/gpu_host.py) ---

HOST_DOC = """Host time around the graphs: where a round's wall time goes besides the GPU's.

For the 8B target + EAGLE head at batch 1 (random weights, prompt 512), per stage (draft round,
verify): wall time vs the GPU time of its graph replays (CUDA events), then the host functions
that take the most time inside each stage (cProfile over the timed rounds; cProfile slows
Python down, so read its column as a ranking, the first table as the truth).

    python -m bench.gpu_rounds host [--tier 3] [--rounds 200] [--out FILE.json]
"""


TOP = 12


def profile_rows(profile: cProfile.Profile, rounds: int) -> list[dict[str, Any]]:
    """The functions with the most own time, per round."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}" if line else file
        rows.append(
            {
                "function": f"{name} ({where})",
                "calls": calls / rounds,
                "own_us": 1e6 * own / rounds,
                "cum_us": 1e6 * cum / rounds,
            }
        )
    return sorted(rows, key=lambda r: -r["own_us"])[:TOP]


def host_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_rounds host", description=HOST_DOC.splitlines()[0]
    )
    parser.add_argument("--tier", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_host.json"))
    args = parser.parse_args(argv)
    info = device_info()
    worker, drafter, states, _ = build_pair("eagle", 1, [1], [args.tier], args.prompt + 2048)
    state = states[args.tier]
    prompt = [torch.randint(0, 128256, (args.prompt,)).tolist()]
    loop = RoundLoop(worker, drafter, prompt)
    drafter.profile = False  # no sync between extend and steps: time it as served
    for _ in range(5):
        loop.step(state)
    wall: dict[str, list[float]] = {"draft": [], "verify": []}
    gpu: dict[str, list[float]] = {"draft": [], "verify": []}
    profiles = {"draft": cProfile.Profile(), "verify": cProfile.Profile()}
    for profiled in (False, True):
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profiled:
                profiles["draft"].enable()
            flight = loop.start(state)  # the round's request built and drafted, as served
            if profiled:
                profiles["draft"].disable()
                profiles["verify"].enable()
            t1 = time.perf_counter()
            loop.finish(flight)  # verify, accept, commit; the EAGLE features recorded
            t2 = time.perf_counter()
            if profiled:
                profiles["verify"].disable()
            else:
                wall["draft"].append(1e3 * (t1 - t0))
                wall["verify"].append(1e3 * (t2 - t1))
                gpu["draft"].append(gpu_ms(drafter))
                gpu["verify"].append(gpu_ms(worker))
    loop.close()
    stages: dict[str, dict[str, Any]] = {
        k: {
            "wall_ms": median(wall[k]),
            "gpu_ms": median(gpu[k]),
            "host_ms": median([w - g for w, g in zip(wall[k], gpu[k], strict=True)]),
            "top": profile_rows(profiles[k], args.rounds),
        }
        for k in wall
    }
    write_json(args.out, {"device": info, "tier": args.tier, "rounds": args.rounds, **stages})
    print(
        f"\nHost time per stage, tier {args.tier}, batch 1, prompt {args.prompt} — "
        f"{info.get('gpu')} (p50 of {args.rounds} rounds)"
    )
    for k, st in stages.items():
        print(
            f"\n{k}: wall {st['wall_ms']:.3f} ms, graphs on the GPU {st['gpu_ms']:.3f} ms, "
            f"host {st['host_ms']:.3f} ms; most own time (cProfile, per round):"
        )
        print(
            format_table(
                ["function", "calls", "own us", "cum us"],
                [
                    [
                        r["function"][:70],
                        f"{r['calls']:.1f}",
                        f"{r['own_us']:.1f}",
                        f"{r['cum_us']:.1f}",
                    ]
                    for r in st["top"]
                ],
            )
        )
    print(
        format_table(
            ["stage", "wall ms", "GPU ms", "host ms"],
            [
                [k, f"{st['wall_ms']:.3f}", f"{st['gpu_ms']:.3f}", f"{st['host_ms']:.3f}"]
                for k, st in stages.items()
            ],
        )
    )


# --- tier-switch (was bench/gpu_tier_switch.py) ---

TIER_SWITCH_DOC = """Tier switching: cost of the switch itself and the first round at the new tier.

    python -m bench.gpu_rounds tier-switch [--out FILE.json]

In-process (EAGLE draft, batch 1): a switch is `state = states[new]`, a dict lookup; "first
round" is the round right after the switch, against the median steady round at that tier.
Captures and state builds are counted across all switches (must stay 0).
"""


def tier_switch_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_rounds tier-switch", description=TIER_SWITCH_DOC.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_tier_switch.json"))
    args = parser.parse_args(argv)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    worker, drafter = pair_workers("eagle", 1, 1024)
    builder = StateBuilder(worker, drafter, buckets=[1])
    states = builder.build_all(tiers)
    prompt = [list(torch.randint(0, 128256, (256,)).tolist())]
    before = builder.captures, builder.builds
    steady = {t: run_rounds(worker, drafter, states[t], prompt, 12).round_s() for t in tiers}
    rows, table = [], []
    loop = RoundLoop(worker, drafter, prompt)
    for _ in range(3):
        loop.step(states[tiers[0]])
    current = states[tiers[0]]
    for old in tiers:
        for new in tiers:
            if old == new:
                continue
            for _ in range(3):  # settle at the old tier
                loop.step(states[old])
            t0 = time.perf_counter_ns()
            current = states[new]  # what ApplyTier does, between two rounds
            switch_ns = time.perf_counter_ns() - t0
            first_s = sum(loop.step(current)[:4])
            rows.append(
                {
                    "from": old,
                    "to": new,
                    "switch_ns": switch_ns,
                    "first_round_s": first_s,
                    "steady_round_s": steady[new],
                }
            )
            table.append(
                [
                    f"{old} → {new}",
                    f"{switch_ns}",
                    f"{1e3 * first_s:.2f}",
                    f"{1e3 * steady[new]:.2f}",
                    f"{first_s / steady[new]:.2f}",
                ]
            )
    loop.close()
    after = builder.captures, builder.builds
    write_json(
        args.out,
        {
            "device": info,
            "rows": rows,
            "captures_builds_during": [after[0] - before[0], after[1] - before[1]],
        },
    )
    print(
        f"\nGPU tier switch, EAGLE draft, batch 1 — {info.get('gpu')}; captures/builds during "
        f"switching: {after[0] - before[0]}/{after[1] - before[1]}"
    )
    print(format_table(["switch", "swap ns", "first round ms", "steady ms", "first/steady"], table))


# --- batch (was bench/gpu_batch.py) ---

BATCH_DOC = """Tokens/s at batch 1, 4, 16, 64 per tier and without speculation, fixed acceptance.

    python -m bench.gpu_rounds batch [--rounds 12] [--out FILE.json]

Fixed acceptance: the draft is the target itself (same weights, its own KV cache), so greedy
drafts are accepted in full (acceptance s per round, up to bf16 ties) and every round yields
s + 1 tokens per request. This prices verify + draft at their maximum payoff; a real draft
costs less per step and accepts less.
"""


def batch_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_rounds batch", description=BATCH_DOC.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_batch.json"))
    args = parser.parse_args(argv)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    worker, drafter, states, capture_s = build_pair(
        "identical", max(args.batches), args.batches, tiers, 512
    )
    print(f"captured {len(tiers)} tiers × {args.batches} in {capture_s:.1f} s")
    rows, table = [], []
    for batch in args.batches:
        prompts = [list(torch.randint(0, 128256, (128,)).tolist()) for _ in range(batch)]
        cells = [str(batch)]
        for tier in [0, *tiers]:
            if tier == 0:
                t = run_rounds(worker, None, states[1], prompts, args.rounds)
            else:
                t = run_rounds(worker, drafter, states[tier], prompts, args.rounds)
            skip = 2
            secs = (
                sum(t.extend[skip:])
                + sum(t.draft[skip:])
                + sum(t.verify[skip:])
                + sum(t.other[skip:])
            )
            toks = sum(t.tokens[skip:])
            accept = toks / (batch * (args.rounds - skip)) - 1
            rows.append({"batch": batch, "tier": tier, "tok_s": toks / secs, "accept": accept})
            cells.append(f"{toks / secs:.0f}" + ("" if tier == 0 else f" ({accept:.1f})"))
        table.append(cells)
    write_json(args.out, {"device": info, "capture_s": capture_s, "rows": rows})
    print(
        f"\nGPU tokens/s (accept length per round), 8B target, identical draft — {info.get('gpu')}"
    )
    print(format_table(["batch", "no spec", "tier 1", "tier 3", "tier 7"], table))


HANDOFF_DOC = """\
A prompt hand-off on the draft service, in process: N prompts of L tokens with their EAGLE-3
features (random), what the target's encode, the draft's decode and the draft's whole answer
(decode, extend, encode) cost, features as bfloat16 bytes, float8 bytes and ring spans.

    python -m bench.gpu_rounds handoff [--prompts 1 2 8 64] [--length 800] [--out FILE.json]
"""


@torch.inference_mode()
def handoff_main(argv: list[str] | None = None) -> None:
    from bench.gpu_speedup import add_pair_args, bench_pair
    from draft_service.rounds import DraftRounds
    from specpair.config import DraftConfig, ServerConfig
    from specpair.rpc.wire import encode_request, read_round, request_from_proto
    from specpair.runtime.engine import GREEDY
    from specpair.runtime.feature_ring import FeatureRing, RingView
    from specpair.runtime.round_messages import DraftInput, RoundRequest

    parser = argparse.ArgumentParser(description=HANDOFF_DOC)
    add_pair_args(parser)
    parser.add_argument("--prompts", type=int, nargs="*", default=[1, 2, 8, 64])
    parser.add_argument("--length", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    target, head = bench_pair(args.shape, args.models_dir, "eagle3", args.device)
    config = DraftConfig(
        ServerConfig("127.0.0.1:0"),
        head,
        draft_kind="eagle",  # type: ignore[arg-type]
        target_path=target,
        device=args.device,
        max_requests=max(args.prompts),
        max_target_requests=max(args.prompts),
        max_len=args.length + 64,
    )
    rounds = DraftRounds(config)
    width, device = rounds.drafter.feature_width, torch.device(args.device)
    n_max = max(args.prompts)
    ring = FeatureRing(n_max * args.length, width, torch.bfloat16, device)
    rows, round_id = [], 0

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for n in args.prompts:
        for how in ("bfloat16", "float8", "ring"):
            times: dict[str, list[float]] = defaultdict(list)
            for _ in range(args.repeats + 1):  # the first: warm-up
                round_id += 1
                feats = [
                    torch.randn(args.length, width, dtype=torch.bfloat16, device=device)
                    for _ in range(n)
                ]
                tokens = tuple(range(1, args.length + 2))
                inputs = tuple(DraftInput(f"p{i}", tokens, GREEDY, f) for i, f in enumerate(feats))
                request = RoundRequest(round_id, 0, inputs)
                sync()
                t0 = time.perf_counter()
                shared = ring.put(round_id, feats) if how == "ring" else []
                data = encode_request(request, how == "float8", shared)
                t1 = time.perf_counter()
                stream = f"bench#{round_id}"
                rounds.rings[stream] = RingView.of(ring)
                wire = read_round(data)
                request_from_proto(wire.message, rounds.rings[stream], wire.feature_data)
                sync()
                t2 = time.perf_counter()
                answer = rounds.run(stream, wire)
                sync()
                t3 = time.perf_counter()
                assert not answer.message.error, answer.message.error
                rounds.release_stream(stream)
                ring.release(round_id)
                for name, ms in (("encode", t1 - t0), ("decode", t2 - t1), ("answer", t3 - t2)):
                    times[name].append(1e3 * ms)
                times["bytes"].append(len(data) / 1e6)
            row = {"prompts": n, "tokens": n * args.length, "features": how}
            row |= {k: round(median(v[1:]), 2) for k, v in times.items()}
            rows.append(row)
            print(row, flush=True)
    if args.out:
        write_json(args.out, {"device": device_info(), "length": args.length, "rows": rows})
    headers = list(rows[0])
    print(format_table(headers, [[str(r[h]) for h in headers] for r in rows]))


MODES = {
    "rounds": rounds_main,
    "profile": profile_main,
    "host": host_main,
    "tier-switch": tier_switch_main,
    "batch": batch_main,
    "handoff": handoff_main,
}


def main(argv: list[str] | None = None) -> None:
    """`MODE [options]`; without a mode, rounds's options."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    mode = args.pop(0) if args and args[0] in MODES else "rounds"
    MODES[mode](args)


if __name__ == "__main__":
    main()
