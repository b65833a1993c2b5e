"""Kernel choices for the batch-1 verify forward, measured against each other on the device.

    python -m bench.gpu_kernels [--out FILE.json]

1. Weight matmuls of the Llama-3-8B shape at M = 1 and 8 rows: cuBLAS (`F.linear`, both BLAS
   back-ends, and the transposed "NN" layout) vs our Triton split-K GEMV writing fp32 partials
   (its consumer sums them; see `triton_kernels.gemv_partials`) over a grid of tile configs.
   Rotating weight copies keep L2 from serving any weight twice.
2. Our Triton tree attention (+ merge) over a grid of `TreeConfig`s, and
   paged attention of q tokens over ctx cached ones, 32 layers per graph replay (one KV pool per
   layer, as served): flashinfer prefill with the tree as custom mask (split-KV as planned, and
   with split-KV disabled) vs causal without a mask.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import device_info, format_table, write_json
from bench.gpu_common import LLAMA3_8B, copy_bandwidth, median, time_cuda
from specpair.runtime.gpu.flashinfer_layout import flat_mask, page_metadata
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def graph_time(body: Callable[[], Any], iters: int = 10) -> float:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return median(time_cuda(graph.replay, iters))


def per_call(fn: Callable[[Tensor, Tensor], Any], x: Tensor, ws: list[Tensor]) -> float:
    """Seconds per call of fn(x, w), over every weight in `ws` in one graph replay."""
    return graph_time(lambda: [fn(x, w) for w in ws]) / len(ws)


def gemm_row(name: str, n: int, k: int, m: int, bw: float, pool_bytes: float) -> dict[str, Any]:
    from specpair.runtime.gpu.triton_kernels import gemv_config, gemv_partials

    nbytes = n * k * 2
    count = max(2, int(pool_bytes // nbytes))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    results: dict[str, float] = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        results[f"linear/{lib}"] = per_call(F.linear, x, ws)
    torch.backends.cuda.preferred_blas_library("default")
    results["nn"] = per_call(torch.matmul, x, [w.t().contiguous() for w in ws[: count // 2 + 1]])
    best = ("", float("inf"))
    grid = itertools.product((1, 2, 4, 8), (32, 64, 128), (128, 256), (3, 4))
    for splits, bn, bk, stages in grid:
        if k % (splits * bk):
            continue
        cfg = (splits, bn, bk, 4, stages)
        t = per_call(partial(gemv_partials, splits=splits, bn=bn, bk=bk, stages=stages), x, ws)
        if t < best[1]:
            best = (str(cfg), t)
    served = gemv_config(n, k)
    assert served is not None
    results["triton"] = best[1]
    s, bn, bk, warps, stages = served
    served_fn = partial(gemv_partials, splits=s, bn=bn, bk=bk, warps=warps, stages=stages)
    results["served"] = per_call(served_fn, x, ws)
    cublas = min(results["linear/cublas"], results["linear/cublaslt"], results["nn"])
    return {
        "weight": name, "m": m, "bytes": nbytes, "triton_cfg": best[0], "served_cfg": short(served),
        **{f"{key}_us": 1e6 * t for key, t in results.items()},
        "triton_of_bw": nbytes / best[1] / bw, "served_of_bw": nbytes / results["served"] / bw,
        "cublas_best_of_bw": nbytes / cublas / bw,
    }  # fmt: skip


def gemm_rows(bw: float, pool_bytes: float = 2e9) -> list[dict[str, Any]]:
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 8)):
        rows.append(gemm_row(name, n, k, m, bw, pool_bytes))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def attention_time(cache: KVCache, layout: BatchLayout, qs: Tensor, variant: str) -> float:
    """Seconds per layer of flashinfer paged prefill, planned as `variant`, 32 layers a replay."""
    a, q = LLAMA3_8B, qs.shape[0]
    indptr, indices, last = page_metadata(
        cache.page_table, layout.slots, layout.starts + q, cache.page_size
    )
    wrapper = cache.attention.flashinfer_wrapper(cache.attention.graph_buffers(1, q))
    wrapper.plan(
        torch.tensor([0, q], dtype=torch.int32), indptr, indices, last,
        a.num_heads, a.num_kv_heads, a.head_dim, cache.page_size,
        custom_mask=None if variant == "causal" else flat_mask(layout).cuda(),
        causal=variant == "causal", disable_split_kv=variant == "mask_nosplit",
        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip

    def body() -> None:
        for layer in range(a.num_layers):
            wrapper.run(qs, (cache.k[layer], cache.v[layer]))

    return graph_time(body, 20) / a.num_layers


def attention_cases(
    queries: tuple[int, ...],
) -> Iterator[tuple[int, int, KVCache, BatchLayout, Tensor]]:
    """(ctx, q, cache, layout, queries [q, Hq, D]) for ctx 512 and 2048: random K/V pages for
    every layer, q causal tree tokens after the context."""
    a = LLAMA3_8B
    for ctx in (512, 2048):
        cache = KVCache.for_model(
            a, max_requests=1, max_len=ctx + 16, dtype=torch.bfloat16, device="cuda"
        )
        cache.k.normal_()
        cache.v.normal_()
        slot = cache.alloc()
        for q in queries:
            layout = BatchLayout(
                torch.tensor([slot]), torch.tensor([ctx]), torch.ones(q, q).tril().bool()[None]
            )
            cache.write_index(layout)
            qs = torch.randn(q, a.num_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
            yield ctx, q, cache, layout, qs
        del cache
        torch.cuda.empty_cache()


def attention_rows() -> list[dict[str, Any]]:
    rows = []
    for ctx, q, cache, layout, qs in attention_cases((1, 2, 4, 8)):
        times = {
            variant: attention_time(cache, layout, qs, variant)
            for variant in ("mask", "mask_nosplit", "causal")
        }
        rows.append({"ctx": ctx, "q": q, **{f"{k}_us": 1e6 * t for k, t in times.items()}})
        print(rows[-1], flush=True)
    return rows


def all_layers(attn: Any, cache: KVCache, qs: Tensor, out: Tensor) -> None:
    for layer in range(cache.k.shape[0]):
        attn.run(qs, (cache.k[layer], cache.v[layer]), out)


def short(cfg: Any) -> str:
    """(splits, block, prefetch, warps) as text: '(32, 32, 0, 4)'."""
    return str(tuple(int(getattr(cfg, f)) for f in cfg.__dataclass_fields__))


def tree_rows(bw: float) -> list[dict[str, Any]]:
    """Our Triton tree attention (+ merge) per layer over a grid of `TreeConfig`s, 32 layers per
    replay; `tree_config`'s choice marked as served."""
    from specpair.runtime.gpu import triton_kernels
    from specpair.runtime.gpu.tree_attention import TreeAttention, TreeConfig, tree_config

    triton_kernels.set_pdl(False)  # each replay's kernels back to back, as timed before PDL

    a = LLAMA3_8B
    heads = (a.num_heads, a.num_kv_heads, a.head_dim)
    # (splits, keys per block, prefetch, warps)
    grid = [
        TreeConfig(*c) for c in itertools.product((16, 32, 64), (32, 64), (False, True), (4, 8))
    ]
    rows = []
    for ctx, q, cache, layout, qs in attention_cases((1, 8)):
        kv_bytes = 2 * (ctx + q) * a.num_kv_heads * a.head_dim * 2  # K and V of one layer
        out = torch.empty_like(qs)
        times: dict[TreeConfig, float] = {}  # per layer
        for cfg in grid:
            attn = TreeAttention(
                batch=1, tokens=q, heads=heads, page_size=cache.page_size,
                pages_per_slot=cache.pages_per_slot, device=torch.device("cuda"), config=cfg,
            )  # fmt: skip
            attn.plan(layout, cache.page_table)
            try:
                replay = graph_time(partial(all_layers, attn, cache, qs, out), 20)
                times[cfg] = replay / a.num_layers
            except Exception as exc:  # a config Triton cannot build: skip it, say so
                print(f"ctx {ctx} q {q} {cfg}: {type(exc).__name__}: {exc}", flush=True)
        best = min(times, key=times.__getitem__)
        served = tree_config(1, a.num_kv_heads, q)
        rows.append({
            "ctx": ctx, "q": q, "best_cfg": short(best), "best_us": 1e6 * times[best],
            "served_cfg": short(served), "served_us": 1e6 * times[served],
            "kv_floor_us": 1e6 * kv_bytes / bw,
            "all_us": {short(k): 1e6 * t for k, t in times.items()},
        })  # fmt: skip
        print({k: v for k, v in rows[-1].items() if k != "all_us"}, flush=True)
    triton_kernels.set_pdl(True)
    return rows


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_kernels.json"))
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--only-tree", action="store_true", help="just the tree attention grid")
    args = parser.parse_args()
    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    tree = tree_rows(bw)
    attn = [] if args.only_tree else attention_rows()
    gemms = [] if args.skip_gemm or args.only_tree else gemm_rows(bw)
    write_json(args.out, {
        "device": info, "copy_bandwidth_Bps": bw, "gemm": gemms, "attn": attn, "tree": tree,
    })  # fmt: skip
    gpu = info.get("gpu")
    print(f"\nTriton tree attention + merge per layer, batch 1, us — {gpu}")
    print(format_table(
        ["ctx", "q", "KV floor", "served", "cfg", "best", "cfg (splits, block, prefetch, warps)"],
        [[str(r["ctx"]), str(r["q"]), f"{r['kv_floor_us']:.1f}", f"{r['served_us']:.1f}",
          r["served_cfg"], f"{r['best_us']:.1f}", r["best_cfg"]] for r in tree],
    ))  # fmt: skip
    if args.only_tree:
        return
    print(f"\nAttention per layer, batch 1, us — {gpu}")
    print(
        format_table(
            ["ctx", "q", "custom mask", "mask, no split-KV", "causal"],
            [
                [
                    str(r["ctx"]),
                    str(r["q"]),
                    f"{r['mask_us']:.1f}",
                    f"{r['mask_nosplit_us']:.1f}",
                    f"{r['causal_us']:.1f}",
                ]
                for r in attn
            ],
        )
    )
    print(f"\nWeight matmuls, us (fraction of copy bandwidth {bw / 1e12:.2f} TB/s) — {gpu}")
    print(
        format_table(
            [
                "weight",
                "M",
                "cuBLAS",
                "cuBLASLt",
                "NN",
                "Triton best",
                "cfg",
                "served",
                "cfg",
                "cuBLAS bw",
                "best bw",
                "served bw",
            ],
            [
                [
                    r["weight"],
                    str(r["m"]),
                    f"{r['linear/cublas_us']:.1f}",
                    f"{r['linear/cublaslt_us']:.1f}",
                    f"{r['nn_us']:.1f}",
                    f"{r['triton_us']:.1f}",
                    r["triton_cfg"],
                    f"{r['served_us']:.1f}",
                    r["served_cfg"],
                    f"{r['cublas_best_of_bw']:.3f}",
                    f"{r['triton_of_bw']:.3f}",
                    f"{r['served_of_bw']:.3f}",
                ]
                for r in gemms
            ],
        )
    )


if __name__ == "__main__":
    main()
