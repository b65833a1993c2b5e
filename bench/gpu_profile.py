"""Where the 8B verify forward's time goes: kernels per replay, idle gaps, GEMM efficiency.

    python -m bench.gpu_profile [--ctx 512] [--queries 1 8] [--out FILE.json]

1. The verify CUDA graph (batch 1, q tokens after ctx) under `torch.profiler`: kernels grouped by
   kind (GEMM, attention, Triton elementwise, other), GPU-busy time vs replay span (the rest is
   idle bus between kernels), and the number of kernels per replay.
2. Every weight GEMM of the model alone at M = q rows (`F.linear`, the cuBLAS call the layers
   make), over enough rotating weight copies that L2 never holds one: achieved weight-read
   bandwidth against the device-to-device copy bandwidth (read + write) that defines the floor.
Kernels launch without programmatic dependent launch here, so each one's time is its own.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.common import device_info, format_table, write_json
from bench.gpu_common import LLAMA3_8B, copy_bandwidth, median, random_llama, time_cuda
from specpair.runtime.gpu.capture import GraphCapture
from specpair.runtime.gpu.fused import fuse_decoder
from specpair.runtime.gpu.verify_graphs import verify_graph
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout


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
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_profile.json"))
    args = parser.parse_args()
    from specpair.runtime.gpu import triton_kernels  # GPU only

    # Kernel durations, not waits: with PDL a kernel launches early and waits inside.
    triton_kernels.set_pdl(False)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    model = random_llama(LLAMA3_8B)
    fuse_decoder(model)
    cache = KVCache.for_model(
        LLAMA3_8B, max_requests=1, max_len=args.ctx + 16, dtype=torch.bfloat16, device="cuda"
    )
    graphs = GraphCapture(cache, 1, "target")
    slot = cache.alloc()
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (1, args.ctx), device="cuda")
    pos = torch.arange(args.ctx, device="cuda")[None]
    model(prompt, pos, cache.bind(BatchLayout.causal([slot], [0], [args.ctx])))
    cache.commit(slot, 0, range(args.ctx))
    profiles, gemms, table = {}, [], []
    for q in args.queries:
        g = verify_graph(graphs, model, 1, q)
        mask = torch.ones(q, q, dtype=torch.bool).tril()[None]
        g.attention[0].plan(BatchLayout(torch.tensor([slot]), torch.tensor([args.ctx]), mask))
        g.inputs["positions"].copy_(torch.arange(args.ctx, args.ctx + q)[None])
        replay = median(time_cuda(g.graph.replay, 30))
        p = profile_graph(g.graph, args.replays)
        p["replay_us"] = 1e6 * replay
        profiles[q] = p
        print(f"q {q}: replay {1e6 * replay:.0f} us, top kernels:")
        for k in p["by_name"][:12]:
            print(f"  {k['us']:8.1f} us  x{k['count']:<4d} {k['name'][:110]}")
        gaps = p["span_us"] - p["busy_us"]
        kinds = p["by_kind_us"]
        table.append(
            [
                str(q),
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
        gemms += gemm_efficiency(model, q, bw)
        del g
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
    print(f"\nVerify graph, batch 1, ctx {args.ctx}, per replay (us) — {info.get('gpu')}")
    print(
        format_table(
            ["q", "replay", "kernels", "busy", "gaps", "gemm", "attention", "triton", "other"],
            table,
        )
    )


if __name__ == "__main__":
    main()
