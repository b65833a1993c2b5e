"""gRPC server plumbing shared by the three services: TLS, ops token, health, compute."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specpair.config import ServerConfig, TLSConfig
from specpair.logging import get_logger
from specpair.rpc.channels import CHANNEL_OPTIONS, MESSAGE_LIMIT
from specpair.rpc.gc_heap import serving
from specpair.rpc.interceptors import BearerTokenInterceptor, MalformedRequestInterceptor

log = get_logger(__name__)
T = TypeVar("T")
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # gRPC binds with SO_REUSEPORT by default: a second service on a taken port would start
    # and split the connections with the first. Ours bind exclusively.
    ("grpc.so_reuseport", 0),
    # Ping idle connections, so a peer whose host vanished (no FIN) is noticed and its calls
    # cancelled, freeing what they hold, within keepalive_time + keepalive_timeout.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


class BindError(RuntimeError):
    """An address this service cannot listen on (taken, or not local); the message names it."""


def compute_executor(name: str, threads: int) -> ThreadPoolExecutor:
    """One thread for model compute, off the event loop, with `threads` intra-op threads."""
    import torch

    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix=name,
        initializer=torch.set_num_threads,
        initargs=(threads,),
    )


def bind_device(device: str) -> None:
    """Makes `device` the calling thread's current CUDA device. Triton launches, CUDA graph
    captures, the current stream and flashinfer's JIT all use the current device, not their
    tensors': a draft given cuda:1 whose thread stays on cuda:0 launches its Triton kernels on
    the wrong GPU ("Pointer argument cannot be accessed from Triton"), and a target on cuda:1
    replaying its graphs from a thread left on cuda:0 read illegal addresses. The current
    device is per thread: a service binds it on its event loop's thread at start-up (where
    `Compute` runs a CUDA round inline) and in each thread that loads (`on_device`)."""
    if device.startswith("cuda:"):  # plain "cuda" is the current device already
        import torch

        torch.cuda.set_device(torch.device(device))


def on_device(device: str, fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run with `device` bound in whatever thread calls it (`asyncio.to_thread` loads)."""

    def bound(*args: Any, **kwargs: Any) -> T:
        bind_device(device)
        return fn(*args, **kwargs)

    return bound


class Compute:
    """Where a service runs its model compute, one call at a time.

    On a CUDA device a call is graph launches and one wait on the GPU: it runs inline on the
    event loop, because handing it to a thread and back costs two thread wake-ups per call, a
    few per cent of a round (`bench/CHOICES.md`). On the CPU a
    call holds a core for tens of milliseconds, so it runs on one worker thread and the loop
    keeps serving meanwhile.
    """

    def __init__(self, name: str, threads: int, device: str) -> None:
        self.inline = device.startswith("cuda")
        self.executor = None if self.inline else compute_executor(name, threads)
        if self.inline:
            import torch

            torch.set_num_threads(threads)  # the loop thread's intra-op threads, as a worker's

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        if self.executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)


async def busy_wait(awaitable: Awaitable[T], budget_s: float) -> T:
    """Awaits `awaitable` with the event loop polling instead of sleeping, for up to `budget_s`.

    Each pass yields to the loop, whose select then returns at once: the loop thread stays on
    its core and sees the peer's message the moment gRPC's poller thread hands it over. After
    the budget it waits as usual (an idle service does not spin).
    """
    if budget_s <= 0:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        deadline = time.perf_counter() + budget_s
        while not task.done() and time.perf_counter() < deadline:
            await asyncio.sleep(0)
        return await task
    finally:
        task.cancel()  # only matters when we were cancelled while it was pending


# A pass with nothing ready this long in a row ends `settle`: a gRPC completion crosses from the
# poller thread through a socket in tens of microseconds, so a call in motion shows up within it.
SETTLE_QUIET_S = 100e-6
SETTLE_BUDGET_S = 2e-3  # and it never holds a round back longer than this,
SETTLE_PER_REQUEST_S = 150e-6  # or than this per running request where that is longer


def settle_budget(requests: int) -> float:
    """How long `settle` may turn the loop after a round of `requests`: each request's stream
    takes passes of its own every round (its event, the detokenized delta, the write and its
    completion), and a request joining takes several more, so a fixed bound that suits a few
    requests keeps a large batch from ever filling at tier 0 (a request always still joining).
    E.g. 16 requests: 2.4 ms; 64: 9.6 ms — a bound, not a wait: idle for 100 µs, it returns."""
    return max(SETTLE_BUDGET_S, requests * SETTLE_PER_REQUEST_S)


async def settle(quiet_s: float = SETTLE_QUIET_S, budget_s: float = SETTLE_BUDGET_S) -> None:
    """Turns the event loop until nothing was ready for `quiet_s` (or `budget_s` passed).

    For a loop that just ran a round inline (CUDA compute holds it for the whole round): one
    yield runs only what was ready then, and a gRPC call needs several passes to reach a
    servicer — each of its completions goes poller thread → socket → loop → the call's task.
    With one yield a round, a request submitted to a target running tier-0 rounds joins several
    rounds late, and a target-only service under-batches. Idle, it costs `quiet_s` a round.
    """
    # asyncio's own run queue; a loop without one (uvloop) gets a single yield.
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    start = busy = time.perf_counter()
    while True:
        await asyncio.sleep(0)
        now = time.perf_counter()
        if ready is None or now - start >= budget_s:
            return
        if ready:
            busy = now
        elif now - busy >= quiet_s:
            return


def peer_host(peer: str) -> str:
    """The host a gRPC peer string names, without its port: what a caller cannot choose (its
    metadata it can). `ipv4:10.0.0.7:51234` → `ipv4:10.0.0.7`, `ipv6:[::1]:51234` →
    `ipv6:[::1]`, `unix:/run/s.sock` → `unix:/run/s.sock`."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rpartition(":")[0]
    return peer


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """TLS with our certificate; with a CA, mutual: a client without a certificate that CA
    signed is refused in the handshake."""
    if tls.cert is None or tls.key is None:
        return None
    ca = tls.ca.read_bytes() if tls.ca else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def _unix_socket_live(path: str) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class GrpcServer:
    """A grpc.aio server with health (NOT_SERVING until `ready()`), reflection, the ops token
    on `protected_methods` and an API key on `keyed_methods`."""

    def __init__(
        self,
        config: ServerConfig,
        service_names: Iterable[str],
        *,
        protected_methods: Iterable[str] = (),
        max_request_bytes: int = MESSAGE_LIMIT,
        api_key: str | None = None,
        keyed_methods: Iterable[str] = (),
    ) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        # First: a caller without the token (the ops methods) or the key (the client methods
        # that cost compute) is refused before its request is parsed.
        if config.ops_token:
            interceptors.append(BearerTokenInterceptor(config.ops_token, protected_methods))
        if api_key:
            interceptors.append(BearerTokenInterceptor(api_key, keyed_methods, "API key"))
        interceptors.append(MalformedRequestInterceptor())
        # Larger requests are refused (RESOURCE_EXHAUSTED) before a byte of them is parsed.
        options = [
            *(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", max_request_bytes),
        ]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        creds = server_credentials(config.tls)
        if config.address.startswith("unix:") and _unix_socket_live(config.address[5:]):
            # gRPC unlinks an existing socket file and binds anew: it would steal the path.
            raise BindError(f"cannot listen on {config.address}: a server is listening there")
        try:
            if creds is None:
                self.port = self.server.add_insecure_port(config.address)
            else:
                self.port = self.server.add_secure_port(config.address, creds)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise BindError(f"cannot listen on {config.address}: address in use or unavailable")

    async def start(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def ready(self) -> None:
        if (took := serving()) is not None:  # a service process: its start-up heap frozen
            log.info(f"heap frozen in {took * 1e3:.0f} ms", objects=gc.get_freeze_count())
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        """Health NOT_SERVING while the server still answers (a service going down)."""
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set(self, status: Any) -> None:
        await self.health.set("", status)
        for name in self.service_names:
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        """NOT_SERVING, then stop: in-flight calls get `grace` seconds, then are cancelled."""
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            async with asyncio.timeout(grace + 5.0):
                await self.server.stop(grace)
        except TimeoutError:
            log.warning("server stop overran its grace period", grace_s=grace)
