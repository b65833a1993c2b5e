"""The controller process: the ControllerService ops API over gRPC plus the AdaptiveController."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from controller.policies.bands import PolicySpec
from controller.policies.sglang import WIRE_FIELD_NAMES, PolicyConfig
from controller.service.controller import AdaptiveController
from specpair.config import ControllerConfig, split_address
from specpair.logging import bounded, get_logger
from specpair.proto.v1 import controller_pb2, controller_pb2_grpc
from specpair.rpc.metrics import ServiceMetrics
from specpair.rpc.serving import GrpcServer
from specpair.runtime.shape import tier_from_wire
from specpair.target_state import TargetState

log = get_logger("controller")

CONTROLLER_REQUEST_BYTES = 1024 * 1024  # a policy update is a few numbers
SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name
PROTECTED_METHODS = tuple(
    f"/{SERVICE_NAME}/{method}" for method in ("GetState", "UpdatePolicy", "PinTier", "Unpin")
)


def policy_to_pb(policy: PolicySpec) -> controller_pb2.PolicyConfig:
    """SGLang's keys and the tree shapes by name, the kind, and every other key as one JSON
    object."""
    values = policy.to_dict()
    kind = values.pop("kind")
    named = {k: values.pop(k) for k in WIRE_FIELD_NAMES if k in values}
    options = json.dumps(values) if values else ""
    return controller_pb2.PolicyConfig(**named, kind=kind, options_json=options)


def target_to_pb(t: TargetState) -> controller_pb2.TargetState:
    return controller_pb2.TargetState(
        target_address=t.target_address,
        connected=t.connected,
        active_steps=t.active_steps,
        ema=t.ema,
        pinned=t.pinned_steps is not None,
        pinned_steps=t.pinned_steps or 0,
        rounds_seen=t.rounds_seen,
        batches_counted=t.batches_counted,
        recent_switches=[
            controller_pb2.TierSwitch(
                round_id=s.round_id,
                from_steps=s.from_steps,
                to_steps=s.to_steps,
                reason=s.reason,
                ema=s.ema,
                unix_time=s.unix_time,
                from_shape=s.from_shape,
                to_shape=s.to_shape,
            )
            for s in t.recent_switches
        ],
        estimates=[
            controller_pb2.TierEstimate(
                steps=e.steps,
                tokens_per_s=e.tokens_per_s,
                round_ms=e.round_ms,
                tokens_per_round=e.tokens_per_round,
                observed_rounds=e.observed_rounds,
                shape=e.shape,
            )
            for e in t.estimates
        ],
        model=t.model,
        active_shape=t.active_shape,
        pinned_shape=t.pinned_shape,
    )


def policy_changes(request: controller_pb2.UpdatePolicyRequest) -> dict[str, Any]:
    """The fields a partial UpdatePolicy sets: optional scalars that are present, lists that
    are non-empty (the request's fields are the policy's keys), tree_shapes where
    set_tree_shapes says so (empty: none), and the keys of `options_json`."""
    changes: dict[str, Any] = {}
    for fd in request.DESCRIPTOR.fields:
        if fd.name in ("options_json", "set_tree_shapes"):
            continue
        if fd.name == "tree_shapes":
            if request.set_tree_shapes:
                changes["tree_shapes"] = tuple(request.tree_shapes)
        elif fd.is_repeated:
            if values := getattr(request, fd.name):
                changes[fd.name] = tuple(values)
        elif request.HasField(fd.name):  # type: ignore[arg-type]
            changes[fd.name] = getattr(request, fd.name)
    if request.options_json:
        try:
            options = json.loads(request.options_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"options_json is not JSON: {exc}") from None
        except RecursionError:
            raise ValueError("options_json: nested too deeply") from None
        if not isinstance(options, dict):
            raise ValueError(f"options_json must be a JSON object, got {request.options_json!r}")
        changes.update(options)
    return changes


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    """Thin: parse, call the AdaptiveController, map ValueError to INVALID_ARGUMENT."""

    def __init__(self, controller: AdaptiveController) -> None:
        self.controller = controller

    def _targets(self) -> list[controller_pb2.TargetState]:
        return [target_to_pb(t) for t in self.controller.snapshot()]

    async def GetState(
        self, request: controller_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.GetStateResponse:
        return controller_pb2.GetStateResponse(
            policy=policy_to_pb(self.controller.policy), targets=self._targets()
        )

    async def UpdatePolicy(
        self, request: controller_pb2.UpdatePolicyRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.UpdatePolicyResponse:
        try:
            policy = await self.controller.update_policy(**policy_changes(request))
        except RecursionError:  # a value nested ~1000 deep, quoted in an error message
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "options_json: nested too deeply")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)))
        return controller_pb2.UpdatePolicyResponse(policy=policy_to_pb(policy))

    async def PinTier(
        self, request: controller_pb2.PinTierRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.PinTierResponse:
        try:
            tier = tier_from_wire(request.speculative_num_steps, request.shape, "shape")
            await self.controller.pin(tier)
        except ValueError as exc:  # a ShapeError too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc)))
        return controller_pb2.PinTierResponse(targets=self._targets())

    async def Unpin(
        self, request: controller_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.UnpinResponse:
        await self.controller.unpin()
        return controller_pb2.UnpinResponse(targets=self._targets())


@dataclass
class RunningController:
    """A started controller: its gRPC server (bound to `port`) and its target watchers."""

    server: GrpcServer
    controller: AdaptiveController
    port: int

    async def stop(self, grace: float = 2.0) -> None:
        await self.controller.stop()
        await self.server.stop(grace)
        log.info("controller stopped")


async def start(
    config: ControllerConfig,
    *,
    policy: PolicySpec | PolicyConfig | None = None,
    metrics: ServiceMetrics | None = None,
) -> RunningController:
    """Starts the controller in this event loop ("127.0.0.1:0" binds an ephemeral port).

    The policy is `policy`, else `config.policy_file` (its kind replaced by
    `config.policy_class` when set), else the defaults; a bad file raises ValueError naming the
    key.
    """
    if policy is None:
        policy = load_policy(config.policy_file, config.policy_class)
    log.info("controller starting", targets=list(config.targets), policy=policy.to_dict())
    metrics = metrics or ServiceMetrics("controller")
    if config.server.metrics_address:
        metrics.serve(*split_address(config.server.metrics_address))
    server = GrpcServer(
        config.server,
        [SERVICE_NAME],
        protected_methods=PROTECTED_METHODS,
        max_request_bytes=CONTROLLER_REQUEST_BYTES,
    )
    controller = AdaptiveController(config, policy, metrics=metrics)
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(
        ControllerServicer(controller), server.server
    )
    await server.start()
    await controller.start()
    # Serving does not wait for targets: the ops API must answer while they are down.
    await server.ready()
    log.info(
        "controller serving",
        address=config.server.address,
        port=server.port,
        ops_token=bool(config.server.ops_token),
        tls=config.server.tls.enabled,
    )
    return RunningController(server=server, controller=controller, port=server.port)


def preflight(config: ControllerConfig) -> None:
    """`specpair serve controller` (and `up`) before anything starts: the policy file read and
    validated, a ValueError naming the file and the key otherwise."""
    load_policy(config.policy_file, config.policy_class)


def load_policy(path: Path | None, policy_class: str | None = None) -> PolicySpec:
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = json.loads(path.read_text())
        except OSError as exc:  # strerror: the path once, not twice
            raise ValueError(f"cannot read policy config {path}: {exc.strerror}") from exc
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"cannot read policy config {path}: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"policy config {path} must be a JSON object")
    if policy_class is not None:
        values["kind"] = policy_class
    try:
        return PolicySpec.from_mapping(values)
    except ValueError as exc:
        raise ValueError(f"policy config {path or policy_class}: {exc}") from exc


async def serve(config: ControllerConfig, *, ready_event: asyncio.Event | None = None) -> None:
    """Runs the controller until cancelled, then stops gracefully."""
    running = await start(config)
    if ready_event is not None:
        ready_event.set()
    try:
        await running.server.server.wait_for_termination()
    finally:
        # Shielded so that the graceful stop completes even though we were cancelled.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(running.stop())
