"""The GPU kernels and single forwards at Llama-3-8B's shape, each against its floor or a library.

    python -m bench.gpu_kernels [kernels] [--only-tree]   GEMV / attention / tree kernels
    python -m bench.gpu_kernels forward [--iters 100]     the verify forward vs HF
    python -m bench.gpu_kernels prefill [--iters 7]       prefill, eager and in graphs
    python -m bench.gpu_kernels sampling [--iters 200]    the sampling and accept kernels
    python -m bench.gpu_kernels tiles [--rows …]          batch-invariant GEMV tiles

`python -m bench.gpu_kernels MODE -h` gives a mode's options. Before they were one entry point
the modes were bench/gpu_kernels.py, gpu_forward.py, gpu_prefill.py, gpu_sampling.py and
gpu_invariant_tiles.py (git history).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoTokenizer

import specpair.runtime.sampling as sampling_module
from bench.common import device_info, format_table, median, write_json
from bench.gpu_common import LLAMA3_8B, copy_bandwidth, time_cuda, weight_bytes
from bench.gpu_speedup import add_pair_args, bench_pair
from bench.prompts import code_prompts
from specpair.models.args import ModelArgs
from specpair.models.llama import LlamaModel
from specpair.models.rope import rope_inv_freq
from specpair.runtime.accept import accept_chains
from specpair.runtime.accept_batch import ChainBatch, accept_candidates, accept_chain_batch
from specpair.runtime.build import StateBuilder, build_target
from specpair.runtime.gpu.capture import GraphCapture
from specpair.runtime.gpu.flashinfer_layout import flat_mask, page_metadata
from specpair.runtime.gpu.fused import GEMV_MAX_ROWS, INVARIANT_TILE, fuse_decoder
from specpair.runtime.gpu.verify_graphs import verify_graph
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    draft_support,
    sample_rows,
    warp_candidates,
    warp_rows,
)
from specpair.runtime.target.worker import TargetSequence

# --- kernels (was bench/gpu_kernels.py) ---

KERNELS_DOC = """\
Kernel choices for the batch-1 verify forward, measured against each other on the device.

    python -m bench.gpu_kernels [kernels] [--out FILE.json]

1. Weight matmuls of the Llama-3-8B shape at M = 1 and 8 rows: cuBLAS (`F.linear`, both BLAS
   back-ends, and the transposed "NN" layout) vs our Triton split-K GEMV writing fp32 partials
   (its consumer sums them; see `triton_kernels.gemv_partials`) over a grid of tile configs.
   Rotating weight copies keep L2 from serving any weight twice.
2. Our Triton tree attention (+ merge) over a grid of `TreeConfig`s, and
   paged attention of q tokens over ctx cached ones, 32 layers per graph replay (one KV pool per
   layer, as served): flashinfer prefill with the tree as custom mask (split-KV as planned, and
   with split-KV disabled) vs causal without a mask.
"""


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
        "weight": name,
        "m": m,
        "bytes": nbytes,
        "triton_cfg": best[0],
        "served_cfg": short(served),
        **{f"{key}_us": 1e6 * t for key, t in results.items()},
        "triton_of_bw": nbytes / best[1] / bw,
        "served_of_bw": nbytes / results["served"] / bw,
        "cublas_best_of_bw": nbytes / cublas / bw,
    }


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
        torch.tensor([0, q], dtype=torch.int32),
        indptr,
        indices,
        last,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        cache.page_size,
        custom_mask=None if variant == "causal" else flat_mask(layout).cuda(),
        causal=variant == "causal",
        disable_split_kv=variant == "mask_nosplit",
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )

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
                batch=1,
                tokens=q,
                heads=heads,
                page_size=cache.page_size,
                pages_per_slot=cache.pages_per_slot,
                device=torch.device("cuda"),
                config=cfg,
            )
            attn.plan(layout, cache.page_table)
            try:
                replay = graph_time(partial(all_layers, attn, cache, qs, out), 20)
                times[cfg] = replay / a.num_layers
            except Exception as exc:  # a config Triton cannot build: skip it, say so
                print(f"ctx {ctx} q {q} {cfg}: {type(exc).__name__}: {exc}", flush=True)
        best = min(times, key=times.__getitem__)
        served = tree_config(1, a.num_kv_heads, q)
        rows.append(
            {
                "ctx": ctx,
                "q": q,
                "best_cfg": short(best),
                "best_us": 1e6 * times[best],
                "served_cfg": short(served),
                "served_us": 1e6 * times[served],
                "kv_floor_us": 1e6 * kv_bytes / bw,
                "all_us": {short(k): 1e6 * t for k, t in times.items()},
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "all_us"}, flush=True)
    triton_kernels.set_pdl(True)
    return rows


@torch.inference_mode()
def kernels_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kernels kernels", description=KERNELS_DOC.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_kernels.json"))
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--only-tree", action="store_true", help="just the tree attention grid")
    args = parser.parse_args(argv)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    tree = tree_rows(bw)
    attn = [] if args.only_tree else attention_rows()
    gemms = [] if args.skip_gemm or args.only_tree else gemm_rows(bw)
    write_json(
        args.out,
        {
            "device": info,
            "copy_bandwidth_Bps": bw,
            "gemm": gemms,
            "attn": attn,
            "tree": tree,
        },
    )
    gpu = info.get("gpu")
    print(f"\nTriton tree attention + merge per layer, batch 1, us — {gpu}")
    print(
        format_table(
            [
                "ctx",
                "q",
                "KV floor",
                "served",
                "cfg",
                "best",
                "cfg (splits, block, prefetch, warps)",
            ],
            [
                [
                    str(r["ctx"]),
                    str(r["q"]),
                    f"{r['kv_floor_us']:.1f}",
                    f"{r['served_us']:.1f}",
                    r["served_cfg"],
                    f"{r['best_us']:.1f}",
                    r["best_cfg"],
                ]
                for r in tree
            ],
        )
    )
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


# --- forward (was bench/gpu_forward.py) ---

FORWARD_DOC = """\
The target forward at Llama-3-8B's shape, batch 1, q tokens after a context, vs the floor.

    python -m bench.gpu_kernels forward [--contexts 512 2048] [--queries 1 2 4 8] [--shards 1 2]
        [--out FILE.json]

floor = weight bytes / device-to-device copy bandwidth (read + write), both measured here.
ours: the verify stage as served (fused layers, Triton tree attention over the paged cache,
one CUDA graph); "graph" times the replay, "+plan" adds the host-side planning that precedes it,
"fi-attn" is the same graph with flashinfer's paged prefill in place of the Triton tree attention,
"no-PDL" the same graph with every kernel launched to wait for the one before (`triton_kernels`).
transformers: the same weights (shared tensors), a StaticCache, eager and under a CUDA graph.
--shards N: also the model one rank of TP=N holds (its heads, KV heads, MLP columns and LM-head
rows, hidden size whole) run alone: what a rank's forward costs with sums that cost nothing,
the floor under the tensor-parallel verify (issue 52).
"""


def shard_of(a: ModelArgs, n: int) -> ModelArgs:
    """One rank's part of `a` at TP=n as a model of its own (o and down keep their output
    width: the partial sums a real rank would add over the ranks)."""
    return replace(
        a,
        vocab_size=-(-a.vocab_size // n),  # VocabParallelHead's rows, the last padded
        intermediate_size=a.intermediate_size // n,
        num_heads=a.num_heads // n,
        num_kv_heads=a.num_kv_heads // n,
    )


def hf_model(a: ModelArgs) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters={"rope_theta": a.rope_theta, **dict(a.rope_scaling)},
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


def ours_from(hf: Any, a: ModelArgs) -> LlamaModel:
    """Our model over the same weight tensors (no copy), then fused (QKV, gate/up concatenated)."""
    with torch.device("meta"):
        model = LlamaModel(a)
    model.load_state_dict(dict(hf.state_dict()), strict=True, assign=True)
    model.inv_freq = rope_inv_freq(a).cuda()
    return fuse_decoder(model.eval())  # type: ignore[return-value]


def hf_timings(hf: Any, a: ModelArgs, ctx: int, q: int, iters: int) -> dict[str, float]:
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=ctx + 16)
    prompt = torch.randint(0, a.vocab_size, (1, ctx), device="cuda")
    out: dict[str, float] = {}
    with torch.inference_mode():
        hf(prompt, past_key_values=cache, cache_position=torch.arange(ctx, device="cuda"))
        ids = torch.randint(0, a.vocab_size, (1, q), device="cuda")
        pos = torch.arange(ctx, ctx + q, device="cuda")
        # transformers 5's StaticLayer ignores `cache_position` on write: it appends at its own
        # device counter `cumulative_length` and advances it, so repeated steps ran past
        # max_cache_len (the `index_copy_` assert). Rewind it to ctx in every step — a device
        # op, so the CUDA graph replays the rewind too and every replay writes ctx .. ctx+q-1.
        counters = [
            layer.cumulative_length
            for layer in getattr(cache, "layers", [])
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        ]

        def step() -> Any:
            for c in counters:
                c.fill_(ctx)
            return hf(ids, past_key_values=cache, cache_position=pos, position_ids=pos[None]).logits

        out["hf_eager"] = median(time_cuda(step, max(5, iters // 5)))
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out["hf_graph"] = median(time_cuda(graph.replay, iters))
        except Exception as exc:  # report, don't abort the run
            print(f"transformers CUDA graph failed at ctx {ctx} q {q}: {exc!r}")
            out["hf_graph"] = float("nan")
    return out


@torch.inference_mode()
def forward_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kernels forward", description=FORWARD_DOC.splitlines()[0]
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument(
        "--shards", type=int, nargs="+", default=[1], help="TP degrees: a rank's part alone"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_forward.json"))
    args = parser.parse_args(argv)
    info = device_info()
    print(f"device: {info.get('gpu')}")
    bw = copy_bandwidth()
    runs: list[dict[str, Any]] = []
    table = []
    whole: dict[tuple[int, int], float] = {}  # TP=1's graph time by (ctx, q): the ratios' base
    for n in sorted(set(args.shards)):
        run = forward_run(shard_of(LLAMA3_8B, n), args, bw)
        if n == 1:
            whole = {(r["ctx"], r["q"]): r["ours_graph_s"] for r in run["rows"]}
        for r in run["rows"]:
            r["shards"] = n
            base = whole.get((r["ctx"], r["q"])) if n > 1 else None
            r["x_whole"] = None if base is None else r["ours_graph_s"] / base
            table.append(
                [str(n), *forward_cells(r), "-" if base is None else f"{r['x_whole']:.3f}"]
            )
        runs.append(run)
    write_json(args.out, {"device": info, "copy_bandwidth_Bps": bw, "runs": runs})
    weights = ", ".join(f"{run['weight_bytes'] / 1e9:.2f}" for run in runs)
    print(
        f"\nGPU forward, Llama-3-8B shape (a rank's part at TP=N), batch 1 — {info.get('gpu')}, "
        f"copy {bw / 1e12:.2f} TB/s, weights {weights} GB"
    )
    print(
        format_table(
            [
                "TP",
                "ctx",
                "q",
                "floor ms",
                "ours ms",
                "×floor",
                "+plan ms",
                "×floor",
                "no-PDL ms",
                "×floor",
                "fi-attn ms",
                "×floor",
                "HF eager ms",
                "HF graph ms",
                "HF ×floor",
                "logit err",
                "× TP 1",
            ],
            table,
        )
    )


def forward_cells(row: dict[str, Any]) -> list[str]:
    """One row of `forward_run` as the table prints it: ms, and each graph's time over the floor."""
    floor = row["floor_s"]
    graphs = ("ours_graph_s", "ours_plan_graph_s", "ours_no_pdl_graph_s", "ours_flashinfer_graph_s")
    return [
        str(row["ctx"]),
        str(row["q"]),
        f"{1e3 * floor:.2f}",
        *(cell for k in graphs for cell in (f"{1e3 * row[k]:.2f}", f"{row[k] / floor:.3f}")),
        f"{1e3 * row['hf_eager_s']:.1f}",
        f"{1e3 * row['hf_graph_s']:.2f}",
        f"{row['hf_graph_s'] / floor:.2f}",
        f"{row['logits_rel_err']:.1e}",
    ]


def forward_run(a: ModelArgs, args: argparse.Namespace, bw: float) -> dict[str, Any]:
    """Every context and query count on the model `a`: a row (JSON) each."""
    from specpair.runtime.gpu import triton_kernels  # GPU only

    hf = hf_model(a)
    wbytes = weight_bytes(hf)
    floor = wbytes / bw
    print(f"weights {wbytes / 1e9:.2f} GB, copy {bw / 1e12:.2f} TB/s, floor {1e3 * floor:.2f} ms")
    model = ours_from(hf, a)
    max_ctx = max(args.contexts)
    cache = KVCache.for_model(
        a, max_requests=1, max_len=max_ctx + 16, dtype=torch.bfloat16, device="cuda"
    )
    graphs = GraphCapture(cache, 1, "target")
    rows = []
    for ctx in args.contexts:
        slot = cache.alloc()
        prompt = torch.randint(0, a.vocab_size, (1, ctx), device="cuda")
        with torch.inference_mode():
            model(
                prompt,
                torch.arange(ctx, device="cuda")[None],
                cache.bind(BatchLayout.causal([slot], [0], [ctx])),
            )
        cache.commit(slot, 0, range(ctx))
        for q in args.queries:
            t0 = time.perf_counter()
            with torch.inference_mode():
                g = verify_graph(graphs, model, 1, q)
            capture_s = time.perf_counter() - t0
            mask = torch.ones(q, q, dtype=torch.bool).tril()[None]
            layout = BatchLayout(torch.tensor([slot]), torch.tensor([ctx]), mask)
            tokens = torch.randint(0, a.vocab_size, (1, q))
            g.inputs["tokens"].copy_(tokens)
            g.inputs["positions"].copy_(torch.arange(ctx, ctx + q)[None])
            g.attention[0].plan(layout)

            def planned(g: Any = g, layout: BatchLayout = layout) -> None:
                g.attention[0].plan(layout)
                g.graph.replay()

            replay = median(time_cuda(g.graph.replay, args.iters))
            with_plan = median(time_cuda(planned, args.iters))
            # the same graph with flashinfer's paged prefill as its attention
            cache.attention.graph_attention = "flashinfer"
            replay_fi = variant_time(graphs, model, layout, tokens, args.iters)
            cache.attention.graph_attention = "triton"
            # and without programmatic dependent launch (each kernel waits for the last)
            triton_kernels.set_pdl(False)
            replay_serial = variant_time(graphs, model, layout, tokens, args.iters)
            triton_kernels.set_pdl(True)
            print(
                f"ours ctx {ctx} q {q}: graph {1e3 * replay:.3f} ms ({replay / floor:.3f}× floor),"
                f" plan+graph {1e3 * with_plan:.3f} ms ({with_plan / floor:.3f}×), "
                f"no PDL {1e3 * replay_serial:.3f} ms, capture {capture_s:.2f} s",
                flush=True,
            )
            hf_t = hf_timings(hf, a, ctx, q, args.iters)
            # same weights: the logits must agree within bf16 tolerance
            with torch.inference_mode():
                g.graph.replay()
                ours_logits = g.outputs["logits"][0].clone()
                ref = hf(prompt_plus(prompt, tokens)).logits[0, -q:].float()
            rel = float((ours_logits - ref).norm() / ref.norm())
            row = {
                "ctx": ctx,
                "q": q,
                "floor_s": floor,
                "ours_graph_s": replay,
                "ours_plan_graph_s": with_plan,
                "ours_flashinfer_graph_s": replay_fi,
                "ours_no_pdl_graph_s": replay_serial,
                "capture_s": capture_s,
                "logits_rel_err": rel,
                **{k + "_s": v for k, v in hf_t.items()},
            }
            rows.append(row)
            del g
        cache.free(slot)
    del model, hf, cache, graphs
    torch.cuda.empty_cache()
    return {"args": asdict(a), "weight_bytes": wbytes, "rows": rows}


def variant_time(
    graphs: GraphCapture, model: LlamaModel, layout: BatchLayout, tokens: torch.Tensor, iters: int
) -> float:
    """Captures a fresh verify graph under the current settings, times its replay (seconds)."""
    q = tokens.shape[1]
    start = int(layout.starts[0])
    with torch.inference_mode():
        g = verify_graph(graphs, model, 1, q)
    g.inputs["tokens"].copy_(tokens)
    g.inputs["positions"].copy_(torch.arange(start, start + q)[None])
    g.attention[0].plan(layout)
    return median(time_cuda(g.graph.replay, iters))


def prompt_plus(prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([prompt, tokens.to(prompt.device)], dim=1)


# --- prefill (was bench/gpu_prefill.py) ---

PREFILL_DOC = """\
What admitting requests costs: the target's prefill time by prompts per call, eager and in
the prefill graphs (`specpair/runtime/gpu/prefill_graphs.py`).

A prefill reads every weight once however few its prompts, and eagerly a small one is bound by
its kernel launches, so admitting requests one or two at a time (as they leave a drafted batch)
costs more per prompt than admitting them in groups (`--join-group`). The grown pair's target
(`bench.gpu_speedup`'s `grown_pair`), the held-out code prompts (96–128 tokens), EAGLE features
kept as a service keeps them; median of `--iters` timed calls after a warm-up, eager and graphed
side by side on one worker.

    python -m bench.gpu_kernels prefill [--groups 1 2 4 8 16 64] [--out FILE.json]
"""


def prefill_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kernels prefill", description=PREFILL_DOC.splitlines()[0]
    )
    add_pair_args(parser)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_prefill.json"))
    args = parser.parse_args(argv)
    target, _ = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    most = max(args.groups)
    worker = build_target(
        target, max_requests=most, max_len=512, keep_features=True, dtype=dtype, device=args.device
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [p.ids for p in code_prompts(tokenizer, 8, 96, 128)]

    def prefill(n: int) -> float:
        seqs = [
            TargetSequence(f"p{i}", prompts[i % len(prompts)], SamplingParams(), 4)
            for i in range(n)
        ]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.prefill(seqs)  # reads the first tokens and features back: synchronous
        seconds = time.perf_counter() - t0
        for seq in seqs:
            worker.release(seq)
        return seconds

    def timed(n: int) -> float:
        for _ in range(2):
            prefill(n)
        return median([1e3 * prefill(n) for _ in range(args.iters)])

    eager = {n: timed(n) for n in args.groups}
    if cuda:
        StateBuilder(worker)  # captures the prefill graphs
    graphed = {n: timed(n) for n in args.groups} if worker.prefill_graphs is not None else {}
    rows, cells = [], []
    for n in args.groups:
        g = graphed.get(n)
        cells.append({"prompts": n, "eager_ms": eager[n], "graph_ms": g})
        rows.append(
            [str(n), f"{eager[n]:.2f}", f"{eager[n] / n:.2f}"]
            + ([f"{g:.2f}", f"{g / n:.2f}", f"{eager[n] / g:.2f}"] if g is not None else ["-"] * 3)
        )
    write_json(args.out, {"device": device_info(), "target": str(target), "cells": cells})
    headers = ["prompts a call", "eager ms", "a prompt", "graph ms", "a prompt", "eager/graph"]
    print(format_table(headers, rows))


# --- sampling (was bench/gpu_sampling.py) ---

SAMPLING_DOC = """\
Sampling kernels on the device: specpair's torch warps, draws and accept against flashinfer's.

Per batch of rows over a Llama-3 vocabulary (128 256), T = 0.7, top-p 0.95, the GPU time (CUDA
events) and the host's wall time (launch to synchronised result) of one call, medians of
`--iters` after warm-up:
- `warp (candidates)`: `warp_rows` as served: the cut among each row's 1024 likeliest tokens;
- `warp (sort)`: the same warp by a stable sort of whole rows (`_sorted_warp`);
- `warp (flashinfer)`: flashinfer's `softmax` and `top_p_renorm_probs` (radix threshold);
- `draw`: `sample_rows`, the inverse CDF of one host uniform per row;
- `draw only (flashinfer)`: `top_k_top_p_sampling_from_logits`: a token, but neither the warped
  p that rejection needs nor a draw from the request's own generator;
- `draft step`: `draft_support`, a draft step's sparse q of 64 tokens;
- `accept, tier 7`: the verify's accept for `rows` requests of 7 drafts (8 rows each): warp,
  `accept_chains`, one read back;
- `accept over the vocabulary`: the warp and `accept_chains` over every row's 128 256 tokens
  (the accept graph of batches with unfiltered rows);
- `accept over candidates`: `accept_candidates`, q sparse over 64 tokens (the accept graph of
  batches whose sampled rows filter);
- `accept over candidates, served eagerly`: `accept_chain_batch` from host inputs, as a verify
  whose batch no accept graph fits runs it (copies in, a sync on coverage, one read back);
- `first token`: a joiner's first token as `TargetWorker._choose` draws it eagerly (warp, draw,
  read back); `first token, graph`: the same in a draw graph (`gpu/draw_graphs.py`);
- `topk 256` / `topk 1024`: a topk of 8 rows a request (1024: the warp's `CANDIDATES`).
Rows marked `graph` replay the same ops captured in a CUDA graph, as the draft's step graphs
and the target's accept graphs run them.

    python -m bench.gpu_kernels sampling [--rows 1 8 64] [--iters 200] [--no-flashinfer]
"""


VOCAB, TEMPERATURE, TOP_P = 128256, 0.7, 0.95
DRAFT_VOCAB = 32_000  # a grown EAGLE-3 head's (`training/grow_eagle3.py`)


def timed_us(fn: Callable[[], Any], iters: int) -> tuple[float, float]:
    """Median GPU and wall microseconds of one call."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    gpu, wall = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append(1e6 * (time.perf_counter() - t0))
        gpu.append(1e3 * start.elapsed_time(end))
    return median(gpu), median(wall)


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured in a CUDA graph (after a warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kernels(rows: int, flashinfer: bool) -> dict[str, Callable[[], Any]]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    # peaked as an LM's logits are: T = 0.7, top-p 0.95 keeps tens of tokens, as on code
    logits = torch.randn(rows, VOCAB, device=dev, generator=gen) * 4
    logits[:, :32] += 24
    host_params = RowParams.of([SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)] * rows)
    params = host_params.to(dev)
    u = torch.rand(rows, device=dev, generator=gen)
    probs = warp_rows(logits, params)
    x = logits / TEMPERATURE

    # tier 7: 8 verify rows per request, 7 drafts drawn from a 64-token q
    tree_logits = torch.randn(rows, 8, VOCAB, device=dev, generator=gen) * 4
    tree_logits[..., :32] += 24
    tree_params = params.repeat(8)
    drafts = torch.randint(0, VOCAB, (rows, 7), device=dev, generator=gen)
    q = torch.zeros(rows, 7, VOCAB, device=dev).scatter_(-1, drafts[..., None], 1.0)
    lengths = torch.full((rows,), 7, device=dev)
    tree_u = torch.rand(rows, 8, device=dev, generator=gen)

    def accept() -> Any:
        p = warp_rows(tree_logits.view(rows * 8, VOCAB), tree_params).view(rows, 8, VOCAB)
        return torch.stack(accept_chains(p, q, drafts, lengths, tree_u)).tolist()

    def accept_over_vocabulary() -> Any:
        p, _ = warp_candidates(tree_logits.view(rows * 8, VOCAB), tree_params)
        return torch.stack(accept_chains(p.view(rows, 8, VOCAB), q, drafts, lengths, tree_u))

    q_ids = torch.randint(
        0, VOCAB, (rows, 7, sampling_module.DRAFT_SUPPORT), device=dev, generator=gen
    )
    q_ids[..., 0] = drafts
    q_sparse = torch.softmax(torch.randn(q_ids.shape, device=dev, generator=gen), -1)
    flat = (tree_logits.view(rows * 8, VOCAB) / TEMPERATURE).contiguous()

    def over_candidates() -> Any:
        return torch.stack(
            accept_candidates(tree_logits, tree_params, drafts, lengths, tree_u, q_ids, q_sparse)
        )

    every = RowParams(params.table, True, True, True)  # a draw graph's: every path captured
    host = ChainBatch(
        host_params.repeat(8),
        drafts.cpu(),
        lengths.cpu(),
        tree_u.cpu(),
        q_ids.cpu(),
        q_sparse.cpu(),
    )

    from specpair.runtime.gpu.draft_sampling import draft_support as one_kernel_support

    # an EAGLE-3 head's step over its 32 000 draft ids (every fourth target id here), sampled
    # where they are (`Eagle3Head.named_logits`) rather than on the whole vocabulary (above)
    named = logits[:, :: VOCAB // DRAFT_VOCAB][:, :DRAFT_VOCAB].contiguous()
    names = torch.arange(DRAFT_VOCAB, device=dev) * (VOCAB // DRAFT_VOCAB)

    out: dict[str, Callable[[], Any]] = {
        "warp (candidates)": lambda: warp_rows(logits, params),
        "warp (sort)": lambda: sampling_module._sorted_warp(x, params),
        "draw": lambda: sample_rows(probs, u),
        "draft step": lambda: draft_support(logits, params, u),
        "accept, tier 7": accept,
        "draft step, graph": graphed(lambda: draft_support(logits, params, u)),
        "draft step, 32k ids named, graph": graphed(
            lambda: draft_support(named, params, u, names=names)
        ),
        "draft step, 32k ids named, one kernel, graph": graphed(
            lambda: one_kernel_support(named, params, u, names=names)
        ),
        "accept over candidates, served eagerly": lambda: accept_chain_batch(tree_logits, host),
        "first token": lambda: sample_rows(warp_rows(logits, params), u).tolist(),
        "first token, graph": graphed(lambda: sample_rows(warp_candidates(logits, every)[0], u)),
        "topk 256, graph": graphed(lambda: flat.topk(256, dim=-1)),
        "topk 1024, graph": graphed(lambda: flat.topk(1024, dim=-1)),
        "accept over the vocabulary, graph": graphed(accept_over_vocabulary),
        "accept over candidates, graph": graphed(over_candidates),
    }
    if not flashinfer:
        return out
    try:
        import flashinfer.sampling as fs
    except ImportError:
        return out
    top_p = torch.full((rows,), TOP_P, device=dev)
    temperature = torch.full((rows,), TEMPERATURE, device=dev)
    out["warp (flashinfer)"] = lambda: fs.top_p_renorm_probs(fs.softmax(logits, temperature), top_p)
    out["draw only (flashinfer)"] = lambda: fs.top_k_top_p_sampling_from_logits(x, VOCAB, top_p)
    return out


def sampling_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kernels sampling",
        description=SAMPLING_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--no-flashinfer", action="store_true", help="skip flashinfer's kernels (JIT at start)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_sampling.json"))
    args = parser.parse_args(argv)
    info = device_info()
    results: dict[str, dict[int, tuple[float, float]]] = {}
    for rows in args.rows:
        for name, fn in kernels(rows, not args.no_flashinfer).items():
            gpu, wall = results.setdefault(name, {})[rows] = timed_us(fn, args.iters)
            print(f"  {name:26s} rows {rows:3d} gpu {gpu:8.1f} us wall {wall:8.1f} us", flush=True)
    write_json(args.out, {"device": info, "vocab": VOCAB, "us (gpu, wall)": results})
    headers = ["kernel", *(f"{r} rows: gpu / wall us" for r in args.rows)]
    table = [
        [n, *(f"{v[r][0]:.0f} / {v[r][1]:.0f}" if r in v else "-" for r in args.rows)]
        for n, v in results.items()
    ]
    print(f"\n{info.get('gpu', info['cpu'])}, vocabulary {VOCAB}, T {TEMPERATURE}, top-p {TOP_P}")
    print(format_table(headers, table))


# --- tiles (was bench/gpu_invariant_tiles.py) ---

TILES_DOC = """\
The batch-invariant mode's matmul tiles: which keep a row's bits, and how fast each is by M.

    python -m bench.gpu_kernels tiles [--rows 1 16 64 1100 4000] [--out FILE.json]

For each weight of the Llama-3-8B shape, the Triton split-K kernel (`gemv_partials`) with the
weight's own split-K and K tiles (`gemv_config`) over a grid of (tile rows, tile width, stages):
whether every row's partials equal, bit for bit, those of the reference tile (64 × 64) at M = 1,
5, 16, 64, 300 and 1100, and ms per call by M beside cuBLAS (`F.linear`, not invariant). What
`fused.INVARIANT_TILE` is chosen from: a tile the row's bits do not depend on, fastest on a
prefill's rows.
"""


BF16 = torch.bfloat16


REFERENCE = (64, 64, None)


TILES = [(GEMV_MAX_ROWS, 64, None), REFERENCE, INVARIANT_TILE]


CHECK_ROWS = (1, 5, 16, 64, 300, 1100)


def partials(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int | None]) -> torch.Tensor:
    from specpair.runtime.gpu.triton_kernels import gemv_config, gemv_partials

    cfg = gemv_config(*w.shape)
    assert cfg is not None
    splits, _, bk, warps, stages = cfg
    bm, bn, tile_stages = tile
    return gemv_partials(x, w, splits, bn, bk, warps, tile_stages or stages, bm=bm)


def ms(fn: Any, iters: int) -> float:
    return 1e3 * median(time_cuda(fn, iters))


def measure(rows: list[int], iters: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=BF16, device="cuda") * 0.02
        x = torch.randn(max(CHECK_ROWS), k, dtype=BF16, device="cuda")
        ref = partials(x, w, REFERENCE)
        xs = {m: torch.randn(m, k, dtype=BF16, device="cuda") for m in rows}
        for tile in TILES:
            same = all(torch.equal(partials(x[:m], w, tile), ref[:, :m]) for m in CHECK_ROWS)
            times = {m: ms(partial(partials, xs[m], w, tile), iters) for m in rows}
            out.append({"weight": name, "tile": list(tile), "same_bits": same, "ms": times})
        times = {m: ms(partial(F.linear, xs[m], w), iters) for m in rows}
        out.append({"weight": name, "tile": "cublas", "same_bits": None, "ms": times})
    return out


def render(results: list[dict[str, Any]], rows: list[int]) -> str:
    def tile_name(tile: Any) -> str:
        if tile == "cublas":
            return "cuBLAS"
        bm, bn, stages = tile
        return f"{bm} x {bn}" + (f", {stages} stages" if stages else "")

    table = [
        [
            r["weight"],
            tile_name(r["tile"]),
            "-" if r["same_bits"] is None else ("yes" if r["same_bits"] else "NO"),
            *(f"{r['ms'][m]:.3f}" for m in rows),
        ]
        for r in results
    ]
    headers = ["weight", "tile", "same bits", *(f"ms at M={m}" for m in rows)]
    return format_table(headers, table)


def tiles_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_kernels tiles",
        description=TILES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1100, 4000])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_invariant_tiles.json"))
    args = parser.parse_args(argv)
    info = device_info()
    results = measure(args.rows, args.iters)
    write_json(args.out, {"device": info, "rows": args.rows, "results": results})
    print(f"device: {info.get('gpu')}; JSON {args.out}\n")
    print(render(results, args.rows))


MODES = {
    "kernels": kernels_main,
    "forward": forward_main,
    "prefill": prefill_main,
    "sampling": sampling_main,
    "tiles": tiles_main,
}


def main(argv: list[str] | None = None) -> None:
    """`MODE [options]`; without a mode, kernels's options."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    mode = args.pop(0) if args and args[0] in MODES else "kernels"
    MODES[mode](args)


if __name__ == "__main__":
    main()
