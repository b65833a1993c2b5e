"""The batch-invariant mode's matmul tiles: which keep a row's bits, and how fast each is by M.

    python -m bench.gpu_invariant_tiles [--rows 1 16 64 1100 4000] [--out FILE.json]

For each weight of the Llama-3-8B shape, the Triton split-K kernel (`gemv_partials`) with the
weight's own split-K and K tiles (`gemv_config`) over a grid of (tile rows, tile width, stages):
whether every row's partials equal, bit for bit, those of the reference tile (64 × 64) at M = 1,
5, 16, 64, 300 and 1100, and ms per call by M beside cuBLAS (`F.linear`, not invariant). What
`fused.INVARIANT_TILE` is chosen from: a tile the row's bits do not depend on, fastest on a
prefill's rows.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import device_info, format_table, write_json
from bench.gpu_common import median, time_cuda
from bench.gpu_kernels import SHAPES
from specpair.runtime.gpu.fused import GEMV_MAX_ROWS, INVARIANT_TILE

BF16 = torch.bfloat16
REFERENCE = (64, 64, None)
# (tile rows, tile width, stages; None: the weight's): the GEMV's, the reference, the mode's
# above GEMV_MAX_ROWS; wider tiles run out of shared memory
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
        [r["weight"], tile_name(r["tile"]),
         "-" if r["same_bits"] is None else ("yes" if r["same_bits"] else "NO"),
         *(f"{r['ms'][m]:.3f}" for m in rows)]
        for r in results
    ]  # fmt: skip
    headers = ["weight", "tile", "same bits", *(f"ms at M={m}" for m in rows)]
    return format_table(headers, table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1100, 4000])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_invariant_tiles.json"))
    args = parser.parse_args()
    info = device_info()
    results = measure(args.rows, args.iters)
    write_json(args.out, {"device": info, "rows": args.rows, "results": results})
    print(f"device: {info.get('gpu')}; JSON {args.out}\n")
    print(render(results, args.rows))


if __name__ == "__main__":
    main()
