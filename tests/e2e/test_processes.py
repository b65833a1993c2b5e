"""End to end: the three real processes (`specpair serve …`), tiny checkpoints, real clients.

One stack, three phases:
  A. identical draft, tier starts at 1: concurrent outputs equal target-only greedy, and the
     controller moves the tier up to 7;
  B. the draft process is SIGKILLed mid-generation: no request is lost or changed;
  C. an unrelated draft comes up on the same port: the target reconnects and the controller
     moves the tier down to 1.
Throughout, neither service builds a runtime state after start-up.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.common import free_address
from specpair.cli.group import Service, ServiceGroup
from specpair.client import ControllerClient, SpecpairClient
from specpair.config.option import lab_variable
from tests.service.conftest import reference_greedy

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
CONNECTED = "DRAFT_CONNECTION_STATE_CONNECTED"
FAST_POLICY = {"warmup_batches": 2, "update_interval": 1, "ema_alpha": 0.5}


def service(
    name: str, address: str, *args: str, metrics: str = "", env: dict[str, str] | None = None
) -> Service:
    return Service(name, address, (*args, "--address", address, "--metrics-address", metrics), env)


def frozen_objects(metrics: str, service: str) -> float:
    """The objects a service process froze once serving (`specpair/rpc/gc_heap.py`)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    name = f"specpair_{service}_gc_frozen_objects"
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ServiceGroup]:
    with ServiceGroup(log_dir=tmp_path, health_timeout_s=120) as group:
        yield group


def test_three_processes(ckpts: dict[str, Path], procs: ServiceGroup, tmp_path: Path) -> None:
    draft_addr, target_addr, ctrl_addr = (free_address() for _ in range(3))
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(FAST_POLICY))
    target = str(ckpts["target"])
    http_addr, target_metrics, draft_metrics = free_address(), free_address(), free_address()
    # Launched together, then waited on: the target and controller come up while peers load.
    for s in (
        service("draft", draft_addr, "draft", "--model", target),
        service(
            "target",
            target_addr,
            "target",
            "--model",
            target,
            "--draft",
            draft_addr,
            "--initial-steps",
            "1",
            "--draft-timeout",
            "15",
            "--http-address",
            http_addr,
            metrics=target_metrics,
        ),
        service(
            "controller", ctrl_addr, "controller", "--target", target_addr, "--policy", str(policy)
        ),
    ):
        procs.launch(s)
    for name in ("draft", "target", "controller"):
        procs.wait_healthy(name)
    client = SpecpairClient(target_addr, timeout=120)
    ctl = ControllerClient(ctrl_addr, timeout=10)
    wait_for(
        lambda: client.server_info().get("draft_connection_state") == CONNECTED,
        30,
        "the target to connect to the draft",
    )
    builds_at_start = client.server_info()["runtime_state_builds"]
    assert builds_at_start == 3
    # serving, the process froze what start-up made: full collections skip it
    assert frozen_objects(target_metrics, "target") > 10_000

    def generate_all(max_tokens: int) -> list[list[int]]:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = pool.map(lambda p: client.generate(p, max_tokens=max_tokens), PROMPTS)
        return [list(r.token_ids) for r in results]

    # A. identical draft: lossless, and the tier climbs 1 → 3 → 7
    expected = reference_greedy(ckpts["target"], PROMPTS, 100)
    assert generate_all(100) == expected
    # The same request through the process's OpenAI-compatible HTTP API: the same text.
    body = {"model": "target", "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0}
    request = urllib.request.Request(
        f"http://{http_addr}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        completion = json.load(response)
    grpc_result = client.generate(PROMPTS[1], max_tokens=30)
    assert completion["choices"][0]["text"] == grpc_result.text
    assert completion["usage"]["completion_tokens"] == len(grpc_result.token_ids) == 30
    for _ in range(10):
        if client.server_info()["speculative_num_steps"] == 7:
            break
        generate_all(40)
    assert client.server_info()["speculative_num_steps"] == 7
    switches = ctl.state().targets[0].recent_switches
    assert [s.to_steps for s in switches if s.reason == "policy"][-1] == 7

    # B. kill -9 the draft while requests run: same outputs, nothing lost
    long = reference_greedy(ckpts["target"], PROMPTS, 400)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate_all, 400)
        wait_for(lambda: client.server_info()["running_requests"] == len(PROMPTS), 30, "the batch")
        procs.procs["draft"].kill()
        assert not running.done(), "generation finished before the draft was killed"
        assert running.result() == long
    assert client.server_info()["draft_connection_state"] != CONNECTED

    # C. an unrelated draft on the same address: reconnect, then the tier falls to 1
    # (with the lab switch that leaves its heap unfrozen, the negative control of the above)
    unfrozen = os.environ | {lab_variable("no_gc_freeze"): "1"}
    draft2 = "draft", "--model", str(ckpts["draft"])
    procs.start(service("draft2", draft_addr, *draft2, metrics=draft_metrics, env=unfrozen))
    assert frozen_objects(draft_metrics, "draft") == 0
    wait_for(
        lambda: client.server_info()["draft_connection_state"] == CONNECTED,
        30,
        "the target to reconnect",
    )
    for _ in range(10):
        assert generate_all(40) == [e[:40] for e in expected]
        if client.server_info()["speculative_num_steps"] == 1:
            break
    assert client.server_info()["speculative_num_steps"] == 1
    assert client.server_info()["runtime_state_builds"] == builds_at_start
