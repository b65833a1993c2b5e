"""What a round's RoundRequest costs on the host, each side of the wire (CPU only, no model).

A round of B requests, each with `rows` new EAGLE feature rows of `width` values (EAGLE-3 on an
8B target: 3 × 4096), encoded as the target sends it and decoded as the draft reads it, with the
features' bytes in one run after the message (`feature_data`, what the target sends) against
each in its own input's Tensor (`inline`, protobuf's own encoding: bytes copied into each
Tensor and again by the serializer). A decode round commits ~5 rows a request; a prompt
hand-off carries the prompt's (~110 here).

    python -m bench.wire_round [--batches 1 8 64] [--rows 5 110] [--width 12288] [--repeats 20]

Before the wire, on the target (`--target-device cuda` on a GPU): a verify's rows read back in
one copy (`kept_rows`), kept in each request's `FeatureLog` (which holds 110 prompt rows
already) and read out for the message, then encoded, ms a round.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, median, write_json
from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import encode_request, read_round, request_from_proto
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.features import FeatureLog
from specpair.runtime.target.worker import kept_rows

LAYOUTS = ("inline", "feature_data")


def round_of(batch: int, rows: int, width: int) -> RoundRequest:
    """`batch` requests of `rows` bfloat16 feature rows each, as `kept_rows` leaves them: views
    of one host tensor read back from the device."""
    feats = torch.randn(batch * rows, width).bfloat16().split(rows)
    tokens = tuple(range(rows))
    inputs = tuple(DraftInput(f"r{i}", tokens, SamplingParams(), f) for i, f in enumerate(feats))
    return RoundRequest(1, 7, inputs)


def time_layout(request: RoundRequest, inline: bool, repeats: int) -> dict[str, float]:
    """Median ms of the encode (to bytes) and the decode (parse, then the typed round): inline,
    as protobuf parses any message; feature_data, as the draft reads it (`read_round`)."""
    encode, decode = [], []
    for _ in range(repeats + 1):  # the first warms allocators
        t0 = time.perf_counter()
        wire = encode_request(request, inline=inline)
        t1 = time.perf_counter()
        if inline:
            request_from_proto(draft_pb2.RoundRequest.FromString(wire))
        else:
            got = read_round(wire)
            request_from_proto(got.message, None, got.feature_data)
        t2 = time.perf_counter()
        encode.append(1e3 * (t1 - t0))
        decode.append(1e3 * (t2 - t1))
    return {"encode_ms": median(encode[1:]), "decode_ms": median(decode[1:]), "mb": len(wire) / 1e6}


def time_target(batch: int, rows: int, width: int, device: str, repeats: int) -> dict[str, float]:
    """Median ms of a round's features on the target, read back and logged (`read_ms`), then
    read out of the logs and encoded (`encode_ms`): `repeats` rounds of one batch in turn,
    after as many untimed, as a serving target runs them (each log kept from its last 33
    rows on, as with `up`'s draft window of 32)."""
    hidden = torch.randn(batch, rows, width, device=device).bfloat16()
    logs = [FeatureLog() for _ in range(batch)]
    for log in logs:
        log.append(torch.randn(110, width).bfloat16())  # a prompt's rows
    keeps, tokens = [range(rows)] * batch, tuple(range(rows))
    read, encode = [], []
    for _ in range(2 * repeats):
        t0 = time.perf_counter()
        for log, got in zip(logs, kept_rows(hidden, keeps), strict=True):
            log.append(got)
            log.trim(log.length - 33)
        t1 = time.perf_counter()
        inputs = tuple(
            DraftInput(f"r{b}", tokens, SamplingParams(), log.since(log.length - rows))
            for b, log in enumerate(logs)
        )
        encode_request(RoundRequest(1, 7, inputs))
        t2 = time.perf_counter()
        read.append(1e3 * (t1 - t0))
        encode.append(1e3 * (t2 - t1))
    return {"read_ms": median(read[repeats:]), "encode_ms": median(encode[repeats:])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rows", type=int, nargs="+", default=[5, 110])
    parser.add_argument("--width", type=int, default=12288)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--target-device", default="cpu", help="where the verify's rows lie")
    parser.add_argument("--out", type=Path, default=Path("bench/out/wire_round.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    for rows in args.rows:
        for batch in args.batches:
            request = round_of(batch, rows, args.width)
            for layout in LAYOUTS:  # side by side, one cell after the other
                cell = time_layout(request, layout == "inline", args.repeats)
                results.append({"rows": rows, "batch": batch, "layout": layout, **cell})
                print(results[-1], flush=True)
    target = [
        {"rows": 5, "batch": b, **time_target(b, 5, args.width, args.target_device, args.repeats)}
        for b in args.batches
    ]
    info = {"device": device_info(), "target_device": args.target_device, "width": args.width}
    write_json(args.out, {**info, "results": results, "target": target})
    table = []
    for inline, ours in zip(results[::2], results[1::2], strict=True):
        before = inline["encode_ms"] + inline["decode_ms"]
        after = ours["encode_ms"] + ours["decode_ms"]
        sizes = [str(ours["rows"]), str(ours["batch"]), f"{ours['mb']:.1f}"]
        times = [f"{c['encode_ms']:.2f} / {c['decode_ms']:.2f}" for c in (inline, ours)]
        table.append([*sizes, *times, f"{before / after:.2f}"])
    print(f"\nwrote {args.out}\n")
    print(f"ms a RoundRequest, encode / decode (features {args.width} bfloat16 a row)")
    headers = ["rows", "batch", "MB", "inline", "feature_data", "x faster"]
    print(format_table(headers, table))
    where = args.target_device
    print(f"\nms a round on the target ({where}): 5 rows a request read back and logged,")
    print("then read out and encoded")
    rows = [[str(c["batch"]), f"{c['read_ms']:.2f}", f"{c['encode_ms']:.2f}"] for c in target]
    print(format_table(["batch", "read + log", "read out + encode"], rows))


if __name__ == "__main__":
    main()
