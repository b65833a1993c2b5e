"""Sampling kernels on the device: specpair's torch warps, draws and accept against flashinfer's.

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
- `topk 256`: the candidates' topk of 8 rows a request.
Rows marked `graph` replay the same ops captured in a CUDA graph, as the draft's step graphs
and the target's accept graphs run them.

    python -m bench.gpu_sampling [--rows 1 8 64] [--iters 200] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import specpair.runtime.sampling as sampling_module
from bench.common import device_info, format_table, write_json
from specpair.runtime.accept import accept_chains
from specpair.runtime.accept_batch import accept_candidates
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    draft_support,
    sample_rows,
    warp_candidates,
    warp_rows,
)  # fmt: skip

VOCAB, TEMPERATURE, TOP_P = 128256, 0.7, 0.95


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
    return statistics.median(gpu), statistics.median(wall)


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
    params = RowParams.of([SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)] * rows).to(dev)
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

    out: dict[str, Callable[[], Any]] = {
        "warp (candidates)": lambda: warp_rows(logits, params),
        "warp (sort)": lambda: sampling_module._sorted_warp(x, params),
        "draw": lambda: sample_rows(probs, u),
        "draft step": lambda: draft_support(logits, params, u),
        "accept, tier 7": accept,
        "draft step, graph": graphed(lambda: draft_support(logits, params, u)),
        "topk 256, graph": graphed(lambda: flat.topk(256, dim=-1)),
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument(
        "--no-flashinfer", action="store_true", help="skip flashinfer's kernels (JIT at start)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_sampling.json"))
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
