"""The target service's settings (`specpair serve target`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from specpair.capabilities import Device, Draft, Modes, Tiers, check
from specpair.config.addresses import (
    DEFAULT_DRAFT_ADDRESS,
    DEFAULT_HTTP_ADDRESS,
    check_grpc_address,
    split_address,
    split_list,
)
from specpair.config.model_service import ModelServiceConfig
from specpair.config.option import lab, option
from specpair.config.server_config import ServerConfig
from specpair.runtime.shape import TreeShape

DEFAULT_MAX_WATCHERS = 8  # WatchRounds streams a target serves at once
DEFAULT_RANK_TIMEOUT_FLOOR_S = 30.0  # `specpair/parallel/watchdog.py` says why


def rank_devices(device: str, tensor_parallel: int) -> tuple[str, ...]:
    """Each rank's device, rank 0 first: `cuda:K` with N ranks takes cuda:K … cuda:K+N-1
    (plain `cuda` is cuda:0: `cuda:2`, 4 ranks → cuda:2, cuda:3, cuda:4, cuda:5); on the CPU
    every rank is `cpu`. One rank keeps the device as given."""
    if tensor_parallel == 1 or not device.startswith("cuda"):
        return (device,) * tensor_parallel
    first = int(device.partition(":")[2] or 0)
    return tuple(f"cuda:{first + rank}" for rank in range(tensor_parallel))


def describe_ranks(device: str, tensor_parallel: int) -> str:
    """Where a target runs, for a start-up line: `cuda:0-3 (tensor-parallel 4)`, `cuda:1`."""
    if tensor_parallel == 1:
        return device
    devices = rank_devices(device, tensor_parallel)
    where = f"{devices[0]}-{devices[-1].partition(':')[2]}" if device != "cpu" else "cpu"
    return f"{where} (tensor-parallel {tensor_parallel})"


class FeatureDType(StrEnum):
    """How a target sends EAGLE features (`specpair.rpc.wire_tensor`)."""

    AUTO = "auto"  # the dtype they were computed in
    FLOAT8 = "float8"  # e4m3, one scale per row


@dataclass(frozen=True, slots=True)
class TargetConfig(ModelServiceConfig):
    server: ServerConfig
    model_path: Path = field(metadata=option("target checkpoint directory", flag="--model"))
    draft_address: str | None = field(
        default=DEFAULT_DRAFT_ADDRESS,
        metadata=option(
            "draft service HOST:PORT or unix:PATH; several replicas as A,B, or a "
            "name resolving to several addresses",
            flag="--draft",
            env="SPECPAIR_DRAFT_ADDRESS",
            off_flag="--no-draft",
            off_help="decode without speculation",
        ),
    )
    initial_steps: int = field(default=3, metadata=option("tier of the first rounds"))
    initial_shape: str = field(
        default="",
        metadata=option(
            "tree-shaped tier of the first rounds, in place of initial_steps (one of tree_shapes)"
        ),
    )
    max_batch: int = field(default=16, metadata=option("requests decoded together"))
    max_queue: int = field(default=256, metadata=option("requests waiting beyond the batch"))
    join_group: int = field(
        default=0,
        metadata=option(
            "while more requests wait than the batch has room for, admit them "
            "this many at a time (each admission's prefill reads every weight); "
            "0: max_batch / 8, at least 1; 1: as soon as a request leaves"
        ),
    )
    join_wait_ms: float = field(
        default=100.0,
        metadata=option(
            "with half of max_batch or more running, a join that cannot ride in a verify "
            "waits beside drafted rounds, at most this long in ms, for join_group requests "
            "to queue, so that one prefill and one joining round serve them (0: joins at "
            "once)"
        ),
    )
    draft_timeout_s: float = field(
        default=5.0,
        metadata=option(
            "the longest a round waits for its drafts, in seconds (a round "
            "carrying a prompt waits this long; an ordinary round's deadline follows "
            "the draft's measured pace, at most this); a round whose drafts come "
            "later is decoded without them and the replica is benched until a "
            "probe answers in time",
            flag="--draft-timeout",
        ),
    )
    draft_deadline_floor_s: float = field(
        default=1.0,
        metadata=option(
            "the shortest deadline an ordinary round's drafts get, in seconds "
            "(the measured pace sets it above this; at most --draft-timeout)",
            flag="--draft-deadline-floor",
        ),
    )
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 5.0
    draft_resolve_s: float = field(
        default=30.0,
        metadata=option(
            "seconds between lookups of a --draft name resolving to several "
            "replicas (pods come and go)",
            flag="--draft-resolve-interval",
        ),
    )
    eos_stop: bool = True  # stop at the eos ids of generation_config.json and the tokenizer
    # "" (the library's default) disables the HTTP API; the command serves it by default.
    http_address: str = field(
        default="",
        metadata=option(
            "HOST:PORT of the OpenAI-compatible HTTP API ('' disables)",
            env="SPECPAIR_HTTP_ADDRESS",
            cli_default=DEFAULT_HTTP_ADDRESS,
        ),
    )
    api_key: str | None = field(
        default=None,
        metadata=option(
            "key clients must send as 'Authorization: Bearer KEY': on HTTP /v1/ "
            "(what OpenAI clients send as api_key) and on gRPC Generate (the SDK "
            "and CLI send SPECPAIR_API_KEY); prefer the variable to the flag, "
            "which other users see in ps",
            env="SPECPAIR_API_KEY",
            secret=True,
        ),
    )
    http_read_timeout_s: float = field(
        default=10.0,
        metadata=option(
            "seconds an HTTP client has to send a request's headers, and again its body",
            flag="--http-read-timeout",
        ),
    )
    max_watchers: int = field(
        default=DEFAULT_MAX_WATCHERS,
        metadata=option(
            "WatchRounds streams served at once (the controller holds one); more are "
            "refused, and one that falls a queue behind is dropped"
        ),
    )
    stats_log_interval_s: float = field(
        default=10.0,
        metadata=option(
            "seconds between throughput log lines (tokens/s, requests, KV cache "
            "use) while there is work; 0: none",
            flag="--stats-log-interval",
        ),
    )
    feature_layers: tuple[int, ...] = field(
        default=(),
        metadata=option(
            "the target layers whose outputs an EAGLE-3 draft reads, 0-based, e.g. "
            "1,2,4 (as its draft reports them; a vLLM head's ids are one more); "
            "default: the final hidden state"
        ),
    )
    feature_dtype: FeatureDType = field(
        default=FeatureDType.AUTO,
        metadata=option(
            "how EAGLE features travel to the draft: auto, as computed (bfloat16 "
            "on CUDA, float32 on the CPU); float8, e4m3 scaled per row (half "
            "bfloat16's bytes, 1 + 4/width bytes a value; drafts change slightly, "
            "outputs do not)"
        ),
    )
    feature_ring_mib: int = field(
        default=0,
        metadata=option(
            "EAGLE features to a draft on this host by reference: a buffer of this "
            "many MiB per draft replica (on the target's GPU, or host memory on the "
            "CPU) that the draft maps, a round's features sent as spans of it, not "
            "bytes; a draft that cannot map it gets bytes; 0: always bytes (off by "
            "default: on an H200 it cut a 64-prompt hand-off's encode from 1.3 s to "
            "2 ms, but showed no gain yet through `up` at 64 clients)"
        ),
    )
    draft_window: int = field(
        default=0,
        metadata=option(
            "tokens of a request's history a draft is sent when it starts the request "
            "(the prompt's last N and, for an EAGLE head, their features; again after a "
            "draft lost it): bounds what a join costs the draft, and lets a prompt longer "
            "than the draft's cache still draft; outputs do not change, acceptance may; "
            "0: the whole history"
        ),
    )
    tensor_parallel: int = field(
        default=1,
        metadata=option(
            "ranks the target model is split over, Megatron-style: this process "
            "serves as rank 0 and starts the others on this machine. On the CPU "
            "over gloo, each rank taking --threads; on GPUs over NCCL, one GPU a "
            "rank: --device cuda:K puts rank r on cuda:K+r (plain cuda: K = 0), "
            "so cuda:K … cuda:K+N-1 must be visible"
        ),
    )
    rank_timeout_floor_s: float = field(
        default=DEFAULT_RANK_TIMEOUT_FLOOR_S,
        metadata=option(
            "with --tensor-parallel: the least time a step may take before a rank counts as "
            "hung and the target exits, in seconds (a step's bound is 8 × the 99th percentile "
            "of recent steps' time per token × its tokens, at least this)",
            flag="--rank-timeout-floor",
        ),
    )
    no_prompt_handoff: bool = field(
        default=False,
        metadata=lab(
            "send a joining request's prompt (and its features) to the draft in its "
            "first round, instead of beside the round it joins during (the hand-off "
            "keeps it off the round's path)"
        ),
    )
    join_settle_ms: float = field(
        default=0.0,
        metadata=lab(
            "before a joining request's prefill beside a drafted round, turn the event loop "
            "for up to this long, in ms (while the draft works), so the last round's streams "
            "reach their clients and new requests arrive first (0: prefill at once)"
        ),
    )
    ride_rows: int = field(
        default=512,
        metadata=lab(
            "a joining request's prompt rides in the verify of the round it joins during "
            "(one forward, one read of the weights, instead of a prefill beside the draft) "
            "where its chunks (of the tier's chain) grow the verify's CUDA graph by at most "
            "this many padded rows (requests × tokens); 0: joiners are prefilled apart"
        ),
    )
    handoff_awaited: bool = field(
        default=False,
        metadata=lab(
            "await the draft's answer to the prompts that rode in a verify before the next "
            "round goes out (default: that round follows them on the stream at once, those "
            "requests flagged `continues`, and the hand-off's answer is read before the "
            "round's)"
        ),
    )
    feed_draft_at_tier_0: bool = field(
        default=False,
        metadata=lab(
            "in a round at tier 0, send the draft what it has not seen (it only extends, "
            "beside the verify, answered after it), so that a positive tier after it appends "
            "one token a request, not every token decoded at tier 0 (and its features)"
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=option(
            "the batch-invariant mode (CUDA): a request's tokens do not depend on "
            "the batch it runs in, its place there, or the tier; greedy speculation "
            "gives the target alone's tokens exactly. Slower: see README"
        ),
    )

    def __post_init__(self) -> None:
        self._resolve()
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        check(self.modes)
        if self.join_wait_ms < 0:
            raise ValueError(f"join_wait_ms must be >= 0 (0: at once), got {self.join_wait_ms}")
        if self.ride_rows < 0:
            raise ValueError(
                f"ride_rows must be >= 0 (0: joiners prefilled apart), got {self.ride_rows}"
            )
        if not self.rank_timeout_floor_s > 0:
            raise ValueError(f"rank_timeout_floor_s must be > 0, got {self.rank_timeout_floor_s}")
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
        if not 0 <= self.join_group <= self.max_batch:
            raise ValueError(
                f"join_group must be in [0, max_batch = {self.max_batch}], got {self.join_group}"
            )
        for name in ("draft_timeout_s", "draft_deadline_floor_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        if self.feature_dtype not in set(FeatureDType):
            choices = ", ".join(FeatureDType)
            raise ValueError(f"feature_dtype must be one of {choices}, got {self.feature_dtype!r}")
        object.__setattr__(self, "feature_dtype", FeatureDType(self.feature_dtype))
        if self.feature_ring_mib < 0:
            raise ValueError(f"feature_ring_mib must be >= 0, got {self.feature_ring_mib}")
        if self.draft_window < 0:
            raise ValueError(
                f"draft_window must be >= 0 (0: the whole history), got {self.draft_window}"
            )
        if any(i < 0 for i in self.feature_layers):
            raise ValueError(
                f"feature_layers must be layer indices >= 0, got {self.feature_layers}"
            )

    def check_gpus(self, visible: int) -> None:
        """Refuses a tensor-parallel target on CUDA whose ranks' GPUs are not all among the
        `visible` ones (`torch.cuda.device_count()`, which `serve` and `up` pass before anything
        loads). Not in `__post_init__`: a config is also built where it will not run (the
        manifests' tests, on machines without GPUs)."""
        if not self.device.startswith("cuda") or self.tensor_parallel == 1:
            return
        devices = rank_devices(self.device, self.tensor_parallel)
        if int(devices[-1].partition(":")[2]) >= visible:
            raise ValueError(
                f"--tensor-parallel {self.tensor_parallel} --device {self.device} puts its ranks "
                f"on {devices[0]} … {devices[-1]}, but {visible} CUDA device"
                f"{'s are' if visible != 1 else ' is'} visible"
            )

    @property
    def modes(self) -> Modes:
        """The axes of `capabilities` this target sets (the draft's kind is the draft's)."""
        return Modes(
            device=Device.of(self.device),
            draft=None if self.draft_address is not None else Draft.NONE,
            tiers=Tiers.of(self.tree_shapes),
            deterministic=self.deterministic,
            tensor_parallel=self.tensor_parallel > 1,
        )

    @property
    def initial_tier(self) -> TreeShape:
        return (
            TreeShape.parse(self.initial_shape)
            if self.initial_shape
            else TreeShape(self.initial_steps)
        )

    @property
    def joins(self) -> int:
        """`join_group` resolved: 0 → max_batch / 8 (batch 64: 8), at least 1."""
        return self.join_group or max(1, self.max_batch // 8)

    @property
    def draft_addresses(self) -> tuple[str, ...]:
        """The draft replicas as configured: `a:1,b:2` → ("a:1", "b:2"); () without a draft."""
        return split_list(self.draft_address or "")
