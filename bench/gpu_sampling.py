"""Sampling kernels on the device: specpair's torch warp and draw against flashinfer's.

Per batch of rows over a Llama-3 vocabulary (128 256), T = 0.7, top-p 0.95, the GPU time (CUDA
events, median of `--iters` after warm-up) of:
- `warp+draw (torch)`: `warp_rows` (one stable sort serves top-k, top-p, min-p) and
  `sample_rows` (inverse CDF of one host uniform per row): what the target runs per round;
- `warp+draw (flashinfer renorm)`: flashinfer's `softmax` and `top_p_renorm_probs` (radix
  threshold, no sort) for the warp, then `sample_rows`;
- `draw only (flashinfer)`: `top_k_top_p_sampling_from_logits`, which gives a token but
  neither the warped p that rejection needs nor a draw from the request's own generator;
- `draft step (torch)`: `draft_support`, a draft step's sparse q of 64 tokens and its draw.

    python -m bench.gpu_sampling [--rows 1 8 64] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.common import device_info, format_table, write_json
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    draft_support,
    sample_rows,
    warp_rows,
)  # fmt: skip

VOCAB, TEMPERATURE, TOP_P = 128256, 0.7, 0.95


def gpu_us(fn: Callable[[], Any], iters: int) -> float:
    """Median GPU microseconds of one call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times)


def kernels(rows: int) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, VOCAB, device="cuda", generator=gen) * 4
    params = RowParams.of([SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)] * rows)
    params = params.to(torch.device("cuda"))
    u = torch.rand(rows, device="cuda", generator=gen)
    out: dict[str, Callable[[], Any]] = {
        "warp+draw (torch)": lambda: sample_rows(warp_rows(logits, params), u),
        "draft step (torch)": lambda: draft_support(logits, params, u),
    }
    try:
        import flashinfer.sampling as fs
    except ImportError:
        return out
    top_p = torch.full((rows,), TOP_P, device="cuda")
    temperature = torch.full((rows,), TEMPERATURE, device="cuda")

    def renorm() -> Tensor:
        probs = fs.softmax(logits, temperature)
        return sample_rows(fs.top_p_renorm_probs(probs, top_p), u)

    out["warp+draw (flashinfer renorm)"] = renorm
    out["draw only (flashinfer)"] = lambda: fs.top_k_top_p_sampling_from_logits(
        logits / temperature[:, None], VOCAB, top_p
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_sampling.json"))
    args = parser.parse_args()
    info = device_info()
    results: dict[str, dict[int, float]] = {}
    for rows in args.rows:
        for name, fn in kernels(rows).items():
            results.setdefault(name, {})[rows] = gpu_us(fn, args.iters)
            print(f"  {name:32s} rows {rows:3d} {results[name][rows]:9.1f} us", flush=True)
    write_json(args.out, {"device": info, "vocab": VOCAB, "us": results})
    headers = ["kernel", *(f"{r} rows (us)" for r in args.rows)]
    table = [[n, *(f"{v[r]:.1f}" for r in args.rows)] for n, v in results.items()]
    print(f"\n{info.get('gpu', info['cpu'])}, vocabulary {VOCAB}, T {TEMPERATURE}, top-p {TOP_P}")
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
