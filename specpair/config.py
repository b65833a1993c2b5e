"""Service configuration: frozen dataclasses, validated once at the edge (CLI, environment)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from specpair.runtime.shape import TreeShape, parse_tiers

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
DEFAULT_MAX_WATCHERS = 8  # WatchRounds streams a target serves at once
# The bundled model pair; `specpair up` falls back to a generated tiny pair without it.
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


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address's host part) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or "" / 0.0.0.0-like wildcards
        return False


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
    """Tier 0 (no drafts: target-only rounds) is a tier like any other, built when listed."""
    if len(steps) < 1 or any(s < 0 for s in steps) or list(steps) != sorted(set(steps)):
        raise ValueError(
            f"candidate_steps must be sorted distinct ints >= 0 (0: no drafts), got {steps}"
        )


def _help(text: str, **cli: object) -> dict[str, object]:
    """Field metadata: a field with help is a `specpair serve` option (specpair.options)."""
    return {"help": text, **cli}


class DType(StrEnum):
    AUTO = "auto"  # float32 on the CPU, bfloat16 on CUDA
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class DraftKind(StrEnum):
    MODEL = "model"  # a standalone small LM sharing the target's tokenizer
    EAGLE = "eagle"  # an EAGLE head over the target's features (needs the target checkpoint)


class PipelineMode(StrEnum):
    """Pipelined rounds (`runtime/draft/pipeline.py`): the draft pre-drafts round n + 1 while the
    target verifies round n."""

    AUTO = "auto"  # the target: on when the draft runs on another device than the target's
    ON = "on"
    OFF = "off"


def check_device(device: str) -> str:
    kind, sep, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (sep and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def same_device(a: str, b: str) -> bool | None:
    """Whether two services' devices are one ("cuda" is "cuda:0"); None when one is unknown.
    Per-process CUDA_VISIBLE_DEVICES can make two "cuda:0" different GPUs: say --pipeline on."""
    if not a or not b:
        return None
    return a.replace("cuda:0", "cuda") == b.replace("cuda:0", "cuda")


BUSY_POLL_MS_CUDA = 20.0
GPU_TENSOR_PARALLEL = (
    "tensor_parallel > 1 runs on the CPU (gloo) only for now: the GPU's fused layers and CUDA "
    "graphs have no all-reduce yet (--device cpu)"
)


def compute_threads(requested: int) -> int:
    """`requested` intra-op threads, or for 0 half the cores (ModelServiceConfig says why)."""
    return requested if requested > 0 else max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelServiceConfig:
    """What the draft and the target both take; every "auto" is resolved here, at construction.

    threads 0 → half the cores: draft and target usually share the machine, and torch ops
    launched from a non-main thread with more OpenMP threads than that ran much slower on a
    2-core CPU (`bench/RESULTS.md`, "Measurements behind choices").

    busy_poll_ms None → 20 on CUDA, 0 on the CPU: a loop that sleeps in epoll while the peer
    computes wakes up cold, so each one-way message arrives later than between two loops that
    never sleep, and the compute right after runs slower. Polling costs a core while a round
    is out, so only a CUDA service, whose compute does not need that core, polls by default.
    """

    candidate_steps: tuple[int, ...] = field(
        default=CANDIDATE_STEPS,
        metadata=_help("tiers (speculative_num_steps) to build; 0: no drafts"),
    )
    tree_shapes: tuple[str, ...] = field(
        default=(),
        metadata=_help("tree-shaped tiers to build beside the chains, STEPSxTOPKxNODES "
                       "(e.g. 4x4x16; repeat the flag for more; CPU only for now)"),
    )  # fmt: skip
    max_len: int = field(
        default=1024,
        metadata=_help("context length served: prompt + max_tokens must fit"),
    )
    device: str = field(default="cpu", metadata=_help("cpu | cuda | cuda:N"))
    dtype: DType = field(default=DType.AUTO, metadata=_help("weights and activations"))
    threads: int = field(
        default=0, metadata=_help("intra-op threads of the compute thread (0: half the cores)")
    )
    busy_poll_ms: float | None = field(
        default=None,
        metadata=_help("poll for the peer's next message this long before sleeping "
                       f"(default: {BUSY_POLL_MS_CUDA:g} on CUDA, 0 on the CPU)"),
    )  # fmt: skip

    def _resolve(self) -> None:
        _check_steps(self.candidate_steps)
        check_device(self.device)
        parse_tiers(self.candidate_steps, self.tree_shapes)  # ShapeError names the shape
        if self.max_len < 1:
            raise ValueError("max_len must be >= 1")
        cuda = self.device.startswith("cuda")
        dtype = DType(self.dtype)  # ValueError names the bad value
        if dtype is DType.AUTO:
            dtype = DType.BFLOAT16 if cuda else DType.FLOAT32
        object.__setattr__(self, "dtype", dtype)
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        object.__setattr__(self, "threads", compute_threads(self.threads))
        poll = self.busy_poll_ms
        if poll is None:
            poll = BUSY_POLL_MS_CUDA if cuda else 0.0
        object.__setattr__(self, "busy_poll_ms", max(float(poll), 0.0))

    @property
    def tiers(self) -> tuple[TreeShape, ...]:
        """Every tier to build: candidate_steps' chains and tree_shapes, sorted."""
        return parse_tiers(self.candidate_steps, self.tree_shapes)

    @property
    def busy_poll_s(self) -> float:
        return (self.busy_poll_ms or 0.0) / 1e3


@dataclass(frozen=True, slots=True)
class TargetConfig(ModelServiceConfig):
    server: ServerConfig
    model_path: Path = field(metadata=_help("target checkpoint directory", flag="--model"))
    draft_address: str | None = field(
        default=DEFAULT_DRAFT_ADDRESS,
        metadata=_help("draft service HOST:PORT or unix:PATH; several replicas as A,B, or a "
                       "name resolving to several addresses", flag="--draft",
                       env="SPECPAIR_DRAFT_ADDRESS", off_flag="--no-draft",
                       off_help="decode without speculation"),
    )  # fmt: skip
    initial_steps: int = field(default=3, metadata=_help("tier of the first rounds"))
    initial_shape: str = field(
        default="", metadata=_help("tree-shaped tier of the first rounds, in place of "
                                   "initial_steps (one of tree_shapes)"),
    )  # fmt: skip
    max_batch: int = field(default=16, metadata=_help("requests decoded together"))
    max_queue: int = field(default=256, metadata=_help("requests waiting beyond the batch"))
    draft_timeout_s: float = field(
        default=5.0,
        metadata=_help("seconds per round; a round whose drafts come later is decoded "
                       "without them", flag="--draft-timeout"),
    )  # fmt: skip
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 5.0
    draft_resolve_s: float = field(
        default=30.0,
        metadata=_help("seconds between lookups of a --draft name resolving to several "
                       "replicas (pods come and go)", flag="--draft-resolve-interval"),
    )  # fmt: skip
    eos_stop: bool = True  # stop at the eos ids of generation_config.json and the tokenizer
    # "" (the library's default) disables the HTTP API; the command serves it by default.
    http_address: str = field(
        default="",
        metadata=_help("HOST:PORT of the OpenAI-compatible HTTP API ('' disables)",
                       env="SPECPAIR_HTTP_ADDRESS", cli_default=DEFAULT_HTTP_ADDRESS),
    )  # fmt: skip
    api_key: str | None = field(
        default=None,
        metadata=_help("key the HTTP API requires on /v1/ as 'Authorization: Bearer KEY' (what "
                       "OpenAI clients send as api_key); prefer the variable to the flag, "
                       "which other users see in ps", env="SPECPAIR_API_KEY", secret=True),
    )  # fmt: skip
    http_read_timeout_s: float = field(
        default=10.0,
        metadata=_help("seconds an HTTP client has to send a request's headers, and again its "
                       "body", flag="--http-read-timeout"),
    )  # fmt: skip
    max_watchers: int = field(
        default=DEFAULT_MAX_WATCHERS,
        metadata=_help("WatchRounds streams served at once (the controller holds one); more are "
                       "refused, and one that falls a queue behind is dropped"),
    )  # fmt: skip
    stats_log_interval_s: float = field(
        default=10.0,
        metadata=_help("seconds between throughput log lines (tokens/s, requests, KV cache "
                       "use) while there is work; 0: none", flag="--stats-log-interval"),
    )  # fmt: skip
    feature_layers: tuple[int, ...] = field(
        default=(),
        metadata=_help("the target layers whose outputs an EAGLE-3 draft reads, 0-based, e.g. "
                       "1,2,4 (as its draft reports them; a vLLM head's ids are one more); "
                       "default: the final hidden state"),
    )  # fmt: skip
    pipeline: PipelineMode = field(
        default=PipelineMode.AUTO,
        metadata=_help("pipelined rounds: the draft pre-drafts the next round while this "
                       "target verifies (auto: when the draft is on another device)"),
    )  # fmt: skip
    tensor_parallel: int = field(
        default=1,
        metadata=_help("ranks the target model is split over, Megatron-style: this process "
                       "serves as rank 0 and starts the others (CPU, gloo; each rank takes "
                       "--threads)"),
    )  # fmt: skip
    deterministic: bool = field(
        default=False,
        metadata=_help("the batch-invariant mode (CUDA): a request's tokens do not depend on "
                       "the batch it runs in, its place there, or the tier; greedy speculation "
                       "gives the target alone's tokens exactly. Slower: see README"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        self._resolve()
        if self.deterministic and not self.device.startswith("cuda"):
            raise ValueError(
                f"deterministic: the batch-invariant mode is a GPU mode (--device cuda), not "
                f"--device {self.device}"
            )
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.device != "cpu":
            raise ValueError(GPU_TENSOR_PARALLEL)
        if self.draft_address is not None:
            if not self.draft_addresses:
                raise ValueError("draft_address: no address (--no-draft decodes without one)")
            for address in self.draft_addresses:
                check_grpc_address(address)
            if len(set(self.draft_addresses)) != len(self.draft_addresses):
                raise ValueError(f"draft_address: an address appears twice in {self.draft_address}")
        if self.draft_resolve_s <= 0:
            raise ValueError(f"draft_resolve_s must be > 0, got {self.draft_resolve_s}")
        if self.http_address:
            split_address(self.http_address)
        if self.api_key is not None and not self.api_key.strip():
            object.__setattr__(self, "api_key", None)  # SPECPAIR_API_KEY="", as compose sets it
        if not 0 < self.http_read_timeout_s <= 3600:
            raise ValueError(
                f"http_read_timeout_s must be in (0, 3600], got {self.http_read_timeout_s}"
            )
        if self.stats_log_interval_s < 0:
            raise ValueError(f"stats_log_interval_s must be >= 0, got {self.stats_log_interval_s}")
        if self.max_watchers < 1:
            raise ValueError(f"max_watchers must be >= 1, got {self.max_watchers}")
        if self.initial_tier not in self.tiers:
            name = "initial_shape" if self.initial_shape else "initial_steps"
            raise ValueError(
                f"{name} {self.initial_tier} is not a candidate {[str(t) for t in self.tiers]}"
            )
        for name in ("max_batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        object.__setattr__(self, "pipeline", PipelineMode(self.pipeline))
        if any(i < 0 for i in self.feature_layers):
            raise ValueError(
                f"feature_layers must be layer indices >= 0, got {self.feature_layers}"
            )

    @property
    def initial_tier(self) -> TreeShape:
        return (
            TreeShape.parse(self.initial_shape)
            if self.initial_shape
            else TreeShape(self.initial_steps)
        )

    @property
    def draft_addresses(self) -> tuple[str, ...]:
        """The draft replicas as configured: `a:1,b:2` → ("a:1", "b:2"); () without a draft."""
        return split_list(self.draft_address or "")


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated list of addresses, blanks dropped."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class DraftConfig(ModelServiceConfig):
    server: ServerConfig
    model_path: Path = field(metadata=_help("draft LM or EAGLE head dir", flag="--model"))
    draft_kind: DraftKind = field(default=DraftKind.MODEL, metadata=_help("what --model is"))
    target_path: Path | None = field(
        default=None, metadata=_help("target checkpoint (EAGLE only)", flag="--target-model")
    )
    max_requests: int = field(default=64, metadata=_help("requests drafted for at once"))
    max_target_requests: int = field(
        default=0,
        metadata=_help("requests one target (all its Round streams) may hold; lower it when "
                       "several targets share this draft (0: max_requests)"),
    )  # fmt: skip
    pipeline: PipelineMode = field(
        default=PipelineMode.ON,
        metadata=_help("pre-draft the next round's likeliest outcomes while the target "
                       "verifies, for targets that ask (off: answer each round only)"),
    )  # fmt: skip
    pipeline_width: int = field(
        default=16,
        metadata=_help("pre-drafted outcomes per round, over the whole batch (each a KV fork; "
                       "slots beyond the batch's)"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        self._resolve()
        object.__setattr__(self, "draft_kind", DraftKind(self.draft_kind))
        object.__setattr__(self, "pipeline", PipelineMode(self.pipeline))
        if self.pipeline is PipelineMode.AUTO:
            raise ValueError("pipeline: the draft takes on or off (auto is the target's)")
        if self.pipeline_width < 1:
            raise ValueError(f"pipeline_width must be >= 1, got {self.pipeline_width}")
        if self.draft_kind is DraftKind.EAGLE and self.target_path is None:
            raise ValueError("draft_kind 'eagle' needs the target checkpoint (--target-model)")
        if self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if not 0 <= self.max_target_requests <= self.max_requests:
            raise ValueError(
                f"max_target_requests must be in [0, max_requests {self.max_requests}], "
                f"got {self.max_target_requests}"
            )
        if self.max_target_requests == 0:
            object.__setattr__(self, "max_target_requests", self.max_requests)

    @property
    def cache_len(self) -> int:
        """Positions a request may hold: the context served plus the deepest tier's drafts."""
        return self.max_len + max(t.draft_headroom for t in self.tiers)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    server: ServerConfig
    targets: tuple[str, ...] = field(
        default=(DEFAULT_TARGET_ADDRESS,),
        metadata=_help("target HOST:PORT, each with its own policy (repeatable, or A,B)",
                       flag="--target",
                       env="SPECPAIR_TARGET_ADDRESS"),
    )  # fmt: skip
    policy_file: Path | None = field(
        default=None,
        metadata=_help("policy JSON file (omitted keys: defaults)", flag="--policy"),
    )
    policy_class: str | None = field(
        default=None,
        metadata=_help("MODULE:CLASS, a SpeculationPolicy class to run instead of the kind (the "
                       "policy file's keys are its options)"),
    )  # fmt: skip
    reconnect_s: float = 1.0
    state_file: Path | None = field(
        default=None,
        metadata=_help("JSON file keeping the pin, the live policy and each target's EMA "
                       "across restarts", env="SPECPAIR_CONTROLLER_STATE"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        # `--target a:1,b:2` and repeated `--target` alike (and SPECPAIR_TARGET_ADDRESS=a:1,b:2)
        object.__setattr__(self, "targets", tuple(a for t in self.targets for a in split_list(t)))
        if not self.targets:
            raise ValueError("the controller needs at least one target address")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets: an address appears twice in {list(self.targets)}")
        for address in self.targets:
            check_grpc_address(address)
