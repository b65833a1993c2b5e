"""`specpair up`: the three services as child processes, started in order, stopped together."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from specpair.config import MODELS_DIR, env_address, env_http_address, split_address
from specpair.healthcheck import check


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specpair"


def default_models(draft_kind: str) -> tuple[Path, Path, str]:
    """(target, draft, note): the bundled pair under models/, else a generated tiny pair."""
    target = MODELS_DIR / "target"
    draft = MODELS_DIR / ("eagle" if draft_kind == "eagle" else "draft")
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft, f"bundled model pair ({target}, {draft})"
    from specpair.models.tiny import make_tiny_eagle, make_tiny_llama

    root = cache_dir() / "tiny-pair"
    tiny_target = root / "target"
    if not (tiny_target / "config.json").is_file():
        make_tiny_llama(tiny_target, seed=1, hidden_size=128, num_layers=4)
    if draft_kind == "eagle":
        tiny_draft = make_tiny_eagle(root / "eagle", tiny_target, seed=3)
    else:
        tiny_draft = root / "draft"
        if not (tiny_draft / "config.json").is_file():
            make_tiny_llama(tiny_draft, seed=2, hidden_size=64, num_layers=1)
    return (
        tiny_target,
        tiny_draft,
        (
            f"NOTE: no bundled models under {MODELS_DIR}; serving a generated tiny RANDOM pair "
            f"({root}) — output is gibberish, acceptance is not meaningful"
        ),
    )


def address_in_use(address: str) -> bool:
    """Whether something already accepts connections at a gRPC address (HOST:PORT, unix:PATH)."""
    if address.startswith("unix:"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: str | tuple[str, int] = address.removeprefix("unix:")
    else:
        target = split_address(address)
        probe = socket.socket(socket.AF_INET6 if ":" in target[0] else socket.AF_INET)
    with probe:
        probe.settimeout(1.0)
        try:
            probe.connect(target)
        except OSError:
            return False
    return True


def wait_healthy(name: str, address: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if check(address, timeout=1.0):
                return
        time.sleep(0.3)
    raise RuntimeError(f"{name} at {address} not healthy after {timeout:.0f} s")


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs.values():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()


def run_up(args: argparse.Namespace) -> int:
    target, draft, note = default_models(args.draft_kind)
    if args.target_model:
        target = args.target_model
    if args.draft_model:
        draft = args.draft_model
    print(f"specpair up: {note}", flush=True)
    serve = [sys.executable, "-m", "specpair.cli", "serve"]
    device = ["--device", args.device]
    draft_cmd = [*serve, "draft", "--model", str(draft), "--draft-kind", args.draft_kind, *device]
    if args.draft_kind == "eagle":
        draft_cmd += ["--target-model", str(target)]
    controller_cmd = [*serve, "controller", "--target", env_address("target")]
    if args.policy:
        controller_cmd += ["--policy", str(args.policy)]
    from specpair.runtime.build import feature_layers  # torch: only when starting services

    target_cmd = [*serve, "target", "--model", str(target), *device]
    if args.draft_kind == "eagle" and (layers := feature_layers(draft, target)):
        target_cmd += ["--feature-layers", ",".join(map(str, layers))]  # an EAGLE-3 head's
    plan = [
        ("draft", env_address("draft"), draft_cmd),
        ("target", env_address("target"), target_cmd),
        ("controller", env_address("controller"), controller_cmd),
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    # SIGTERM (kill, docker, systemd) stops the group as Ctrl-C does, children included.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for name, address, cmd in plan:
            # Our service would fail to bind, but the health check could reach the other process
            # first and report it as ours.
            if address_in_use(address):
                raise RuntimeError(
                    f"{name}: {address} is already in use by another process "
                    f"(stop it, or set SPECPAIR_{name.upper()}_ADDRESS)"
                )
            print(f"specpair up: starting {name} on {address} …", flush=True)
            procs[name] = subprocess.Popen(cmd)
            wait_healthy(name, address, procs[name], timeout=300)
            print(f"specpair up: {name} is serving", flush=True)
        http = env_http_address()  # the target's default, as it read it
        api = f", the OpenAI-compatible API at http://{http}/v1" if http else ""
        print(f"specpair up: all services up{api} (Ctrl-C stops them)", flush=True)
        if args.demo:
            from specpair.demo import run_demo

            token = os.environ.get("SPECPAIR_OPS_TOKEN")  # the services read the same one
            run_demo(env_address("target"), env_address("controller"), http, token=token)
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    print(
                        f"specpair up: {name} exited with code {proc.returncode}; "
                        "stopping the others",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nspecpair up: stopping …", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"specpair up: {exc}; stopping the others", file=sys.stderr)
        return 1
    finally:
        _stop_all(procs)
