"""The specpair SDK: generate from a target service, and drive the controller's ops API.

    with SpecpairClient() as client:              # 127.0.0.1:50051 or $SPECPAIR_TARGET_ADDRESS
        result = client.generate("Once upon a time", max_tokens=32)
        print(result.text, result.avg_accept_length)
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)  # chat template

    async with AsyncSpecpairClient("host:50051", token=..., tls="ca.pem") as client:
        async for delta in client.stream([1, 2, 3], max_tokens=32, temperature=0.8, seed=0):
            print(delta.text, end="")

Importing this package must not import torch: it is all a client needs on its machine.
"""

from specpair.client.aio import AsyncControllerClient, AsyncSpecpairClient
from specpair.client.requests import GenerateParams, build_pin, build_policy_update
from specpair.client.results import (
    ControllerState,
    GenerateDelta,
    GenerateResult,
    SpecpairError,
)
from specpair.client.sync import ControllerClient, SpecpairClient
from specpair.target_state import TargetState, TierSwitch

__all__ = [
    "AsyncControllerClient",
    "AsyncSpecpairClient",
    "ControllerClient",
    "ControllerState",
    "GenerateDelta",
    "GenerateParams",
    "GenerateResult",
    "SpecpairClient",
    "SpecpairError",
    "TargetState",
    "TierSwitch",
    "build_pin",
    "build_policy_update",
]
