"""Service configuration: frozen dataclasses, validated once at the edge (CLI, environment).

One module per concern; import from here (`from specpair.config import TargetConfig`):
addresses.py (defaults, environment, checks), server_config.py (`ServerConfig`, `TLSConfig`),
model_service.py (`ModelServiceConfig`, what the draft and the target both take), target.py,
draft.py, controller.py (each service's own), option.py (a field's `specpair serve` option, or
its lab switch). What modes combine is `specpair/capabilities.py`, which the configs read.
"""

from specpair.config.addresses import (
    DEFAULT_CONTROLLER_ADDRESS,
    DEFAULT_DRAFT_ADDRESS,
    DEFAULT_HTTP_ADDRESS,
    DEFAULT_METRICS,
    DEFAULT_TARGET_ADDRESS,
    check_grpc_address,
    env_address,
    env_http_address,
    is_loopback,
    split_address,
    split_list,
)
from specpair.config.controller import ControllerConfig
from specpair.config.draft import MAX_HANDOFF_ROWS, DraftConfig, DraftKind
from specpair.config.model_service import (
    BUSY_POLL_MS_CUDA,
    CANDIDATE_STEPS,
    MODELS_DIR,
    DType,
    ModelServiceConfig,
    check_device,
    compute_threads,
)
from specpair.config.server_config import ServerConfig, TLSConfig
from specpair.config.target import (
    DEFAULT_MAX_WATCHERS,
    DEFAULT_RANK_TIMEOUT_FLOOR_S,
    FeatureDType,
    TargetConfig,
    describe_ranks,
    rank_devices,
)

__all__ = [
    "BUSY_POLL_MS_CUDA",
    "CANDIDATE_STEPS",
    "DEFAULT_CONTROLLER_ADDRESS",
    "DEFAULT_DRAFT_ADDRESS",
    "DEFAULT_HTTP_ADDRESS",
    "DEFAULT_MAX_WATCHERS",
    "DEFAULT_METRICS",
    "DEFAULT_RANK_TIMEOUT_FLOOR_S",
    "DEFAULT_TARGET_ADDRESS",
    "MAX_HANDOFF_ROWS",
    "MODELS_DIR",
    "ControllerConfig",
    "DType",
    "DraftConfig",
    "DraftKind",
    "FeatureDType",
    "ModelServiceConfig",
    "ServerConfig",
    "TLSConfig",
    "TargetConfig",
    "check_device",
    "check_grpc_address",
    "compute_threads",
    "describe_ranks",
    "env_address",
    "env_http_address",
    "is_loopback",
    "rank_devices",
    "split_address",
    "split_list",
]
