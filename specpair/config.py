"""Service configuration: frozen dataclasses, validated once at the edge (CLI, environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TARGET_ADDRESS = "127.0.0.1:50051"
DEFAULT_DRAFT_ADDRESS = "127.0.0.1:50052"
DEFAULT_CONTROLLER_ADDRESS = "127.0.0.1:50053"
DEFAULT_METRICS = {
    "target": "127.0.0.1:9451",
    "draft": "127.0.0.1:9452",
    "controller": "127.0.0.1:9453",
}
# The target's OpenAI-compatible HTTP API (`specpair serve target --http-address`).
DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"
CANDIDATE_STEPS = (1, 3, 7)
# The bundled model pair (issue 4); `specpair up` falls back to a generated tiny pair.
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def env_address(service: str) -> str:
    """SPECPAIR_<SERVICE>_ADDRESS or the default address of `service`."""
    defaults = {
        "target": DEFAULT_TARGET_ADDRESS,
        "draft": DEFAULT_DRAFT_ADDRESS,
        "controller": DEFAULT_CONTROLLER_ADDRESS,
    }
    return os.environ.get(f"SPECPAIR_{service.upper()}_ADDRESS", defaults[service])


def env_http_address() -> str:
    """SPECPAIR_HTTP_ADDRESS or the default address of the target's HTTP API."""
    return os.environ.get("SPECPAIR_HTTP_ADDRESS", DEFAULT_HTTP_ADDRESS)


def compute_threads(requested: int) -> int:
    """Intra-op threads for a service's compute thread.

    Draft and target usually share the machine, and torch ops launched from a non-main thread
    with more than one OpenMP thread ran ~1.8x slower on a 2-core CPU (bench/RESULTS.md), so
    the default gives each service half the cores.
    """
    return requested if requested > 0 else max(1, (os.cpu_count() or 2) // 2)


BUSY_POLL_MS_CUDA = 20.0


def busy_poll_s(requested_ms: float | None, device: str) -> float:
    """How long a service keeps its event loop polling for the peer's next message, in seconds.

    A loop that sleeps in epoll while the peer computes wakes up cold: on the lent H100 host
    (a VM) each one-way message took ~0.46 ms against ~0.15 ms between two loops that never
    sleep, and the compute right after ran slower. Polling costs a core while a round is out,
    so it is on by default only on a CUDA device (where compute does not need that core).
    """
    if requested_ms is None:
        requested_ms = BUSY_POLL_MS_CUDA if device.startswith("cuda") else 0.0
    return max(requested_ms, 0.0) / 1e3


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def check_grpc_address(address: str) -> str:
    """A gRPC address: HOST:PORT, or unix:PATH for a Unix domain socket (services on one host)."""
    if address.startswith("unix:"):
        if not address.removeprefix("unix:").strip("/"):
            raise ValueError(f"address {address!r}: unix: needs a socket path")
        return address
    try:
        split_address(address)
    except ValueError:
        raise ValueError(f"address {address!r} must be HOST:PORT or unix:PATH") from None
    return address


@dataclass(frozen=True, slots=True)
class TLSConfig:
    cert: Path | None = None  # server certificate (servers) / client certificate (mTLS)
    key: Path | None = None
    ca: Path | None = None  # CA that signs the peer's certificate

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS needs both a certificate and a key (--tls-cert, --tls-key)")
        for p in (self.cert, self.key, self.ca):
            if p is not None and not Path(p).is_file():
                raise ValueError(f"TLS file {p} does not exist")

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @staticmethod
    def from_env() -> TLSConfig:
        def path(name: str) -> Path | None:
            value = os.environ.get(name)
            return Path(value) if value else None

        return TLSConfig(
            path("SPECPAIR_TLS_CERT"), path("SPECPAIR_TLS_KEY"), path("SPECPAIR_TLS_CA")
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    address: str
    metrics_address: str = ""  # "" disables /metrics
    ops_token: str | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        check_grpc_address(self.address)
        if self.metrics_address:
            split_address(self.metrics_address)


def _check_steps(steps: tuple[int, ...]) -> None:
    if len(steps) < 1 or any(s < 1 for s in steps) or list(steps) != sorted(set(steps)):
        raise ValueError(f"candidate_steps must be sorted distinct positive ints, got {steps}")


@dataclass(frozen=True, slots=True)
class TargetConfig:
    server: ServerConfig
    model_path: Path
    draft_address: str | None = DEFAULT_DRAFT_ADDRESS  # None: no speculation
    candidate_steps: tuple[int, ...] = CANDIDATE_STEPS
    initial_steps: int = 3
    max_batch: int = 16
    max_len: int = 1024  # context length served: prompt + max_tokens must fit
    max_queue: int = 256
    draft_timeout_s: float = 5.0  # a round whose drafts come later is decoded without them
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 5.0
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # intra-op threads of the compute thread; 0: half the cores (see below)
    busy_poll_ms: float | None = None  # None: see busy_poll_s
    eos_stop: bool = True  # stop at the eos ids of generation_config.json and the tokenizer
    http_address: str = ""  # HOST:PORT of the OpenAI-compatible HTTP API; "" disables it
    feature_layers: tuple[int, ...] = ()  # EAGLE-3 draft: send these layers' outputs as features

    def __post_init__(self) -> None:
        if self.draft_address is not None:
            check_grpc_address(self.draft_address)
        if self.http_address:
            split_address(self.http_address)
        _check_steps(self.candidate_steps)
        if self.initial_steps not in self.candidate_steps:
            raise ValueError(
                f"initial_steps {self.initial_steps} is not a candidate {self.candidate_steps}"
            )
        for name in ("max_batch", "max_len", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        if any(i < 0 for i in self.feature_layers):
            raise ValueError(
                f"feature_layers must be layer indices >= 0, got {self.feature_layers}"
            )


@dataclass(frozen=True, slots=True)
class DraftConfig:
    server: ServerConfig
    model_path: Path
    draft_kind: str = "model"  # "model" (standalone LM) | "eagle" (needs target_path)
    target_path: Path | None = None
    candidate_steps: tuple[int, ...] = CANDIDATE_STEPS
    max_requests: int = 64
    max_len: int = 1024
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # intra-op threads of the compute thread; 0: half the cores (see below)
    busy_poll_ms: float | None = None  # None: see busy_poll_s

    def __post_init__(self) -> None:
        _check_steps(self.candidate_steps)
        if self.draft_kind not in ("model", "eagle"):
            raise ValueError(f"draft_kind must be 'model' or 'eagle', got {self.draft_kind!r}")
        if self.draft_kind == "eagle" and self.target_path is None:
            raise ValueError("draft_kind 'eagle' needs the target checkpoint (--target-model)")


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    server: ServerConfig
    targets: tuple[str, ...] = (DEFAULT_TARGET_ADDRESS,)
    policy_file: Path | None = None
    policy_class: str | None = None  # "module:Class", a SpeculationPolicy instead of the kind
    reconnect_s: float = 1.0
    state_file: Path | None = None  # pin, live policy and EMAs kept across restarts

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("the controller needs at least one target address")
        for address in self.targets:
            check_grpc_address(address)
