"""The controller's settings (`specpair serve controller`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specpair.config.addresses import DEFAULT_TARGET_ADDRESS, check_grpc_address, split_list
from specpair.config.option import option
from specpair.config.server_config import ServerConfig


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    server: ServerConfig
    targets: tuple[str, ...] = field(
        default=(DEFAULT_TARGET_ADDRESS,),
        metadata=option(
            "target HOST:PORT, each with its own policy (repeatable, or A,B)",
            flag="--target",
            env="SPECPAIR_TARGET_ADDRESS",
        ),
    )
    policy_file: Path | None = field(
        default=None,
        metadata=option("policy JSON file (omitted keys: defaults)", flag="--policy"),
    )
    policy_class: str | None = field(
        default=None,
        metadata=option(
            "MODULE:CLASS, a SpeculationPolicy class to run instead of the kind (the "
            "policy file's keys are its options)"
        ),
    )
    reconnect_s: float = 1.0
    state_file: Path | None = field(
        default=None,
        metadata=option(
            "JSON file keeping the pin, the live policy and each target's EMA across restarts",
            env="SPECPAIR_CONTROLLER_STATE",
        ),
    )

    def __post_init__(self) -> None:
        # `--target a:1,b:2` and repeated `--target` alike (and SPECPAIR_TARGET_ADDRESS=a:1,b:2)
        object.__setattr__(self, "targets", tuple(a for t in self.targets for a in split_list(t)))
        if not self.targets:
            raise ValueError("the controller needs at least one target address")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets: an address appears twice in {list(self.targets)}")
        for address in self.targets:
            check_grpc_address(address)
