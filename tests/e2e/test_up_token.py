"""`specpair up` with no ops token set makes one for its group: the services require it, so an
anonymous local process can neither hold the draft's slots nor the target's watcher places,
while `specpair ctl` (which finds the token where `up` kept it) and clients still work."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench.common import free_address
from bench.services import wait_draft_connected
from bench.up_client import running_up
from specpair.cli.options import TOKEN_ENV
from specpair.client import SpecpairClient
from specpair.config import MODELS_DIR
from specpair.proto.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow


def test_up_without_a_token_shuts_anonymous_peers_out(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "specpair.cli",
        "up",
        "--device",
        "cpu",
        "--target-model",
        str(MODELS_DIR / "target"),
        "--draft-model",
        str(MODELS_DIR / "draft"),
    ]
    draft = free_address()
    env = {TOKEN_ENV: None, "XDG_CACHE_HOME": str(tmp_path), "SPECPAIR_DRAFT_ADDRESS": draft}
    with running_up(command, tmp_path / "up.log", env_changes=env) as up:
        kept = tmp_path / "specpair" / "ops-token"
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert "made one for this group" in (tmp_path / "up.log").read_text()

        with grpc.insecure_channel(draft) as channel:  # an anonymous Round stream
            stream = draft_pb2_grpc.DraftServiceStub(channel).Round(
                iter([draft_pb2.RoundRequest(round_id=1, speculative_num_steps=3)])
            )
            with pytest.raises(grpc.RpcError) as refused:
                next(stream)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(up.target) as channel:  # an anonymous watcher
            watch = target_pb2_grpc.TargetServiceStub(channel).WatchRounds(
                target_pb2.WatchRoundsRequest()
            )
            with pytest.raises(grpc.RpcError) as refused:
                next(watch)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # the target reaches its draft with the token: requests are drafted
        client = SpecpairClient(up.target, timeout=120)
        wait_draft_connected(client, timeout_s=120)
        result = client.generate([5, 6, 7, 8], max_tokens=16)
        assert len(result.token_ids) == 16 and result.rounds < 16
        # ctl, with no token in its environment, finds the one `up` kept
        ctl_env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        ctl_env |= {"XDG_CACHE_HOME": str(tmp_path), "SPECPAIR_CONTROLLER_ADDRESS": up.controller}
        status = subprocess.run(
            [sys.executable, "-m", "specpair.cli", "ctl", "status"],
            env=ctl_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert up.target in status.stdout
