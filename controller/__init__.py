"""The controller: adaptive tier policy, per-target round watchers and the ops API."""

from controller.controller import AdaptiveController, TargetSnapshot, TierSwitch
from controller.policy import AdaptiveSpeculativeParams, PolicyConfig, snap_to_candidate
from controller.server import ControllerServicer, RunningController, serve, start

__all__ = [
    "AdaptiveController",
    "AdaptiveSpeculativeParams",
    "ControllerServicer",
    "PolicyConfig",
    "RunningController",
    "TargetSnapshot",
    "TierSwitch",
    "serve",
    "snap_to_candidate",
    "start",
]
