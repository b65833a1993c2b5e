"""The real services as child processes on free loopback ports, for benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.common import free_address
from specpair.cli.group import Service, ServiceGroup
from specpair.client import SpecpairClient
from specpair.config.option import lab_variable
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from specpair.rpc.channels import auth_metadata
from specpair.rpc.wire import apply_tier_to_proto, stats_from_proto
from specpair.runtime.build import feature_layers
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import TreeShape

LINKS = ("tcp", "unix")


def add_lab_arg(parser: argparse.ArgumentParser, example: str) -> None:
    """`--lab FIELD=VALUE`, repeatable: a lab switch for the services a benchmark starts."""
    parser.add_argument(
        "--lab",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"a lab switch for the services, e.g. {example} (ARCHITECTURE.md, 'Lab switches')",
    )


def lab_env(fields: Mapping[str, str]) -> dict[str, str]:
    """Lab switches by field as the environment sets them: {"no_prompt_handoff": "1"} →
    {"SPECPAIR_LAB_NO_PROMPT_HANDOFF": "1"}; `--lab` items by field: `lab_fields`."""
    return {lab_variable(name): value for name, value in fields.items()}


def lab_fields(items: Sequence[str]) -> dict[str, str]:
    """`--lab` items by field: ["no_prompt_handoff=1"] → {"no_prompt_handoff": "1"}."""
    return {name: value for name, _, value in (item.partition("=") for item in items)}


def link_address(link: str, name: str) -> tuple[str, str | None]:
    """(address, socket dir): a free loopback HOST:PORT for "tcp" (no dir), or for "unix" the
    socket `name` in a new temporary dir, which the caller removes when done."""
    if link not in LINKS:
        raise ValueError(f"link {link!r}: one of {LINKS}")
    if link == "tcp":
        return free_address(), None
    sockets = tempfile.mkdtemp(prefix="specpair-")  # a short path: sockets stop at ~107 bytes
    return f"unix:{sockets}/{name}.sock", sockets


class BenchServices(ServiceGroup):
    """draft + target (+ controller when `policy` is given) on free loopback ports; with
    `draft=None` the target alone (`--no-draft`), for a target-only baseline.

    `device`/`dtype` go to both model services, `draft_device` (default: `device`) to the draft
    alone, e.g. target on cuda:0 and draft on cuda:1; `max_len` and `candidate_steps` to both
    (None: the command's defaults). `link` is the target's wire to the draft: loopback "tcp" or
    a "unix" domain socket. Each service is given its device as `specpair up` gives it
    (`--device cuda:1`). `draft_options` / `target_options`: more flags for the draft / target
    service (e.g. ("--max-batch", "64")). `lab`: lab switches for every service, by field
    (`{"no_prompt_handoff": "1"}`: `SPECPAIR_LAB_NO_PROMPT_HANDOFF=1`; ARCHITECTURE.md, "Lab
    switches"); `busy_poll_ms` is one.
    """

    def __init__(
        self,
        *,
        target: Path,
        draft: Path | None,
        log_dir: Path,
        policy: dict[str, Any] | None = None,
        draft_kind: str = "model",
        initial_steps: int = 3,
        threads: int = 0,
        device: str = "cpu",
        draft_device: str | None = None,
        dtype: str | None = None,
        max_len: int | None = None,
        candidate_steps: Sequence[int] | None = None,
        busy_poll_ms: float | None = None,
        cpus: dict[str, set[int]] | None = None,
        link: str = "tcp",
        draft_options: Sequence[str] = (),
        target_options: Sequence[str] = (),
        lab: Mapping[str, str] | None = None,
    ) -> None:
        self.draft, self.socket_dir = link_address(link, "draft")
        self.target, self.controller = free_address(), free_address()
        quiet = ("--metrics-address", "", "--log-level", "INFO")
        model: tuple[str, ...] = ("--threads", str(threads), *quiet)  # both model services
        steps = ",".join(map(str, candidate_steps or ()))
        options = {"--dtype": dtype, "--max-len": max_len, "--candidate-steps": steps}
        for flag, value in options.items():
            if value:
                model += (flag, str(value))
        switches = dict(lab or {})
        if busy_poll_ms is not None:
            switches["busy_poll_ms"] = str(busy_poll_ms)
        # No HTTP API: benchmarks speak gRPC, and groups side by side must not share port 8000.
        env = {**os.environ, "SPECPAIR_HTTP_ADDRESS": ""}
        env.update(lab_env(switches))
        draft_arg, target_arg = draft_device or device, device
        pins = {name: frozenset(ids) for name, ids in (cpus or {}).items()}
        services = []
        draft_link: tuple[str, ...] = ("--no-draft",)
        if draft is not None:
            draft_args = ("draft", "--address", self.draft, "--model", str(draft),
                          "--draft-kind", draft_kind, "--device", draft_arg, *model)  # fmt: skip
            if draft_kind == "eagle":
                draft_args += ("--target-model", str(target))
            draft_args += tuple(draft_options)
            services.append(Service("draft", self.draft, draft_args, env, pins.get("draft")))
            draft_link = ("--draft", self.draft)
        target_args = ("target", "--address", self.target, "--model", str(target),
                       *draft_link, "--initial-steps", str(initial_steps),
                       "--device", target_arg, *model)  # fmt: skip
        if (
            draft is not None
            and draft_kind == "eagle"
            and (layers := feature_layers(draft, target))
        ):
            target_args += ("--feature-layers", ",".join(map(str, layers)))  # an EAGLE-3 head's
        target_args += tuple(target_options)
        services.append(Service("target", self.target, target_args, env, pins.get("target")))
        if policy is not None:
            policy_file = log_dir / "policy.json"
            policy_file.write_text(json.dumps(policy))
            controller_args = ("controller", "--address", self.controller, "--target",
                               self.target, "--policy", str(policy_file), *quiet)  # fmt: skip
            services.append(Service("controller", self.controller, controller_args, env))
        super().__init__(services, log_dir=log_dir)

    def stop(self) -> None:
        super().stop()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def wait_draft_connected(client: SpecpairClient, timeout_s: float = 300.0) -> None:
    """Until the target's link to its draft is up (speculation can start); a draft the target
    refused, or none within `timeout_s`, fails with the target's reason."""
    deadline = time.monotonic() + timeout_s
    while (info := client.server_info())["draft_connection_state"] != (
        "DRAFT_CONNECTION_STATE_CONNECTED"
    ):
        refused = info.get("draft_incompatible_reason")
        if refused or time.monotonic() > deadline:
            raise RuntimeError(f"the draft never connected: {refused or 'timed out'}")
        time.sleep(0.1)


def apply_tier(address: str, tier: TreeShape | str | int) -> None:
    """Pins the target's tier (ApplyTier, as the controller does) from its next round on: a chain
    (3, "3") or a tree ("4x4x16"), which both services must have built (`--tree-shapes`)."""
    shape = tier if isinstance(tier, TreeShape) else TreeShape.parse(tier)
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        stub.ApplyTier(apply_tier_to_proto(shape, reason="bench"))


def watch_rounds(address: str, sink: list[RoundStats], token: str | None = None) -> grpc.Future:
    """Collects the target's RoundStats (typed: `specpair.rpc.wire` decodes them) in a thread until
    the returned call is cancelled; `token`: the ops token, where the target has one."""
    channel = grpc.insecure_channel(address)
    call = target_pb2_grpc.TargetServiceStub(channel).WatchRounds(
        target_pb2.WatchRoundsRequest(), metadata=auth_metadata(token)
    )

    def collect() -> None:
        with contextlib.suppress(grpc.RpcError):
            sink.extend(stats_from_proto(r.round) for r in call)
        channel.close()  # the call ended (cancelled): one channel a watch, not one left open

    threading.Thread(target=collect, daemon=True).start()
    return call


@contextlib.contextmanager
def rounds_watched(
    address: str,
    sink: list[RoundStats],
    token: str | None = None,
    before_s: float = 0.1,
    after_s: float | None = None,
) -> Iterator[None]:
    """`watch_rounds` around a timed block: subscribed `before_s` ahead of it (no round is
    missed), and ended `after_s` (default `before_s`) after it (the last round's stats in)."""
    call = watch_rounds(address, sink, token)
    time.sleep(before_s)
    try:
        yield
    finally:
        time.sleep(before_s if after_s is None else after_s)
        call.cancel()
