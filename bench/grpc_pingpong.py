"""The transport floor under a speculation round: one bidi stream between two processes, ping-pong.

Each round trip mimics a round between the services: the client (the target) writes a request
of `--request-bytes`, the server (the draft) holds its thread for `--hold-ms` (its compute,
inline as on a GPU), answers with `--response-bytes`, and the client holds its thread for the
second `--hold-ms` (the verify) before the next write. The transport time of a trip is its wall
time minus both holds, the same split `bench.round_overhead` calls "rpc". Modes:

- `aio`: grpc.aio on both sides, plain awaits;
- `aio+poll`: grpc.aio with `specpair.rpc.serving.busy_wait` on both reads (what the services do);
- `sync`: grpc's threaded API (server handler thread, client iterator fed from a queue);
- `tcp`: asyncio streams with a length prefix, no gRPC (the event loop's own floor).

    python -m bench.grpc_pingpong [--trips 400] [--hold-ms 2 6] [--modes aio aio+poll sync tcp]
        [--links tcp unix]

`--links tcp unix` runs every mode over loopback TCP and over a Unix domain socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from bench.common import cpu_list, device_info, format_table, percentile, write_json
from bench.services import LINKS, link_address
from specpair.rpc.serving import busy_wait

MODES = ("aio", "aio+poll", "sync", "tcp")
PERCENTILES = (("p50", 50), ("p90", 90), ("p99", 99))
METHOD = "/specpair.bench.PingPong/Echo"
POLL_S = 0.02  # as BUSY_POLL_MS_CUDA
WARMUP = 50
HEADER = struct.Struct("<d")  # the server's hold, in seconds, leads each answer
LENGTH = struct.Struct("<I")


def answer(request: bytes, size: int, hold_s: float) -> bytes:
    """Holds the thread for `hold_s` (as inline compute waiting on the GPU does), then answers."""
    start = time.perf_counter()
    time.sleep(hold_s)
    held = time.perf_counter() - start
    return HEADER.pack(held) + bytes(max(size - HEADER.size, 0))


# --- servers (a child process each) ---


def serve_grpc_aio(endpoint: str, size: int, hold_s: float, poll: bool) -> None:
    async def echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        stream = aiter(requests)
        while True:
            try:
                request = await busy_wait(anext(stream), POLL_S if poll else 0.0)
            except StopAsyncIteration:
                return
            yield answer(request, size, hold_s)

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([_handlers(grpc.stream_stream_rpc_method_handler(echo))])
        server.add_insecure_port(endpoint)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def serve_grpc_sync(endpoint: str, size: int, hold_s: float) -> None:
    def echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for request in requests:
            yield answer(request, size, hold_s)

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([_handlers(grpc.stream_stream_rpc_method_handler(echo))])
    server.add_insecure_port(endpoint)
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def serve_tcp(endpoint: str, size: int, hold_s: float) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_frame(reader)
                writer.write(_frame(answer(request, size, hold_s)))
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def main() -> None:
        if endpoint.startswith("unix:"):
            server = await asyncio.start_unix_server(echo, endpoint.removeprefix("unix:"))
        else:
            host, port = endpoint.rsplit(":", 1)
            server = await asyncio.start_server(echo, host, int(port))
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


def _handlers(handler: grpc.RpcMethodHandler) -> grpc.GenericRpcHandler:
    service, _, method = METHOD.strip("/").partition("/")
    return grpc.method_handlers_generic_handler(service, {method: handler})


def _frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    return await reader.readexactly(n)


# --- clients: each returns the transport time of every trip, in seconds ---


def client_grpc_aio(
    endpoint: str, request: bytes, trips: int, hold_s: float, poll: bool
) -> list[float]:
    async def main() -> list[float]:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = channel.stream_stream(METHOD)()
            times = []
            for _ in range(WARMUP + trips):
                start = time.perf_counter()
                await call.write(request)
                reply = await busy_wait(call.read(), POLL_S if poll else 0.0)
                times.append(time.perf_counter() - start - HEADER.unpack_from(reply)[0])
                time.sleep(hold_s)  # the verify, inline
            await call.done_writing()
            return times[WARMUP:]

    return asyncio.run(main())


def client_grpc_sync(endpoint: str, request: bytes, trips: int, hold_s: float) -> list[float]:
    with grpc.insecure_channel(endpoint) as channel:
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        replies = channel.stream_stream(METHOD)(iter(outbox.get, None))
        times = []
        for _ in range(WARMUP + trips):
            start = time.perf_counter()
            outbox.put(request)
            reply = next(replies)
            times.append(time.perf_counter() - start - HEADER.unpack_from(reply)[0])
            time.sleep(hold_s)
        outbox.put(None)
        return times[WARMUP:]


def client_tcp(endpoint: str, request: bytes, trips: int, hold_s: float) -> list[float]:
    async def main() -> list[float]:
        if endpoint.startswith("unix:"):
            reader, writer = await asyncio.open_unix_connection(endpoint.removeprefix("unix:"))
        else:
            host, port = endpoint.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
        times = []
        for _ in range(WARMUP + trips):
            start = time.perf_counter()
            writer.write(_frame(request))
            await writer.drain()
            reply = await _read_frame(reader)
            times.append(time.perf_counter() - start - HEADER.unpack_from(reply)[0])
            time.sleep(hold_s)
        writer.close()
        return times[WARMUP:]

    return asyncio.run(main())


def run_mode(mode: str, link: str, args: argparse.Namespace) -> list[float]:
    """Starts the mode's server in a child process on `link` (loopback "tcp" or a "unix" domain
    socket), runs the client here, stops the server."""
    endpoint, sockets = link_address(link, "pingpong")
    command = [
        sys.executable, "-m", "bench.grpc_pingpong", "--serve", mode, "--endpoint", endpoint,
        "--response-bytes", str(args.response_bytes), "--hold-ms", *map(str, args.hold_ms),
    ]  # fmt: skip
    server_cpus = args.server_cpus
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode} server did not start on {endpoint}")
        request = bytes(args.request_bytes)
        hold_s = args.hold_ms[1] / 1e3
        clients: dict[str, Callable[[], list[float]]] = {
            "aio": lambda: client_grpc_aio(endpoint, request, args.trips, hold_s, poll=False),
            "aio+poll": lambda: client_grpc_aio(endpoint, request, args.trips, hold_s, poll=True),
            "sync": lambda: client_grpc_sync(endpoint, request, args.trips, hold_s),
            "tcp": lambda: client_tcp(endpoint, request, args.trips, hold_s),
        }
        return clients[mode]()
    finally:
        child.terminate()
        child.wait(timeout=10)
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)


def serve(mode: str, endpoint: str, size: int, hold_s: float) -> None:
    if mode in ("aio", "aio+poll"):
        serve_grpc_aio(endpoint, size, hold_s, poll=mode == "aio+poll")
    elif mode == "sync":
        serve_grpc_sync(endpoint, size, hold_s)
    else:
        serve_tcp(endpoint, size, hold_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--trips", type=int, default=400, help="timed round trips per mode")
    parser.add_argument("--request-bytes", type=int, default=16384, help="an EAGLE round's size")
    parser.add_argument("--response-bytes", type=int, default=512, help="a tier-7 tree's size")
    parser.add_argument(
        "--hold-ms", type=float, nargs=2, default=[2.0, 6.0], metavar=("DRAFT", "VERIFY"),
        help="thread holds around each trip: the server's draft, the client's verify",
    )  # fmt: skip
    parser.add_argument(
        "--links", nargs="+", choices=LINKS, default=["tcp"],
        help="loopback tcp and/or a unix domain socket (rows 'MODE/unix'), every mode on each",
    )  # fmt: skip
    parser.add_argument("--client-cpus", type=cpu_list, help="pin the client, e.g. 0-1")
    parser.add_argument("--server-cpus", type=cpu_list, help="pin the server, e.g. 2-3")
    parser.add_argument("--out", type=Path, default=Path("bench/out/grpc_pingpong.json"))
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.endpoint, args.response_bytes, args.hold_ms[0] / 1e3)
        return
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    results = {}
    for link in args.links:
        for mode in args.modes:
            name = mode if link == "tcp" else f"{mode}/{link}"
            print(f"{name}: {args.trips} round trips ...", flush=True)
            us = [1e6 * t for t in run_mode(mode, link, args)]
            results[name] = {q: percentile(us, v) for q, v in PERCENTILES}
    write_json(args.out, {
        "device": device_info(), "grpc": grpc.__version__, "trips": args.trips,
        "request_bytes": args.request_bytes, "response_bytes": args.response_bytes,
        "hold_ms": args.hold_ms, "transport_us": results,
    })  # fmt: skip
    print(f"\ntransport time per round trip (wall minus holds {args.hold_ms} ms), "
          f"{args.request_bytes} B out / {args.response_bytes} B back, grpc {grpc.__version__}, "
          f"{device_info()['cpu']}")  # fmt: skip
    rows = [[m, *(f"{r[q]:.0f}" for q in ("p50", "p90", "p99"))] for m, r in results.items()]
    print(format_table(["mode", "p50 us", "p90 us", "p99 us"], rows))


if __name__ == "__main__":
    main()
