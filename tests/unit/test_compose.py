"""docker-compose.yml (+ the CPU and tensor-parallel overlays) and docker/Dockerfile, checked
without Docker.

Docker cannot run in CI, so: the files validate against the compose-spec JSON schema (vendored
in tests/data/ from check-jsonschema 0.39, Apache-2.0, see compose-spec.LICENSE), every command
is `specpair serve <role>` and parses with the real CLI parser, healthchecks go through
grpc.health.v1 (and the probe is exercised against a real server), start order waits on health,
ports are published, and the overlay merged the way Compose merges it removes every GPU need.
Where `docker compose` happens to be installed, it validates the files too.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from specpair.config import ServerConfig
from specpair.rpc import healthcheck
from specpair.rpc.serving import GrpcServer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERLAY = ROOT / "docker-compose.cpu.yml"
TP_OVERLAY = ROOT / "docker-compose.tp.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SCHEMA = Path(__file__).resolve().parents[1] / "data" / "compose-spec.json"
ROLES = ("draft", "target", "controller")
GPU_ROLES = ("draft", "target")


# ---- loading and merging like Compose ----------------------------------------------------------


class _Reset:
    """`!reset`: the key disappears from the merged model."""


class _Override:
    """`!override value`: replaces instead of merging."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
_ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: _Override(
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    ),
)


def load(path: Path) -> dict[str, Any]:
    with path.open() as f:
        data = yaml.load(f, Loader=_ComposeLoader)  # a SafeLoader that knows two more tags
    assert isinstance(data, dict)
    return data


# Compose replaces these instead of appending (compose-spec "merge", exceptions).
_REPLACED = {"command", "entrypoint", "test"}


def merge(base: Any, over: Any, key: str = "") -> Any:
    """The Compose merge rules our files rely on: mappings merge, `command` / `entrypoint` /
    `healthcheck.test` are replaced, other sequences append, `!reset` removes, `!override`
    replaces."""
    if isinstance(over, _Override):
        return copy.deepcopy(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = copy.deepcopy(base)
        for k, v in over.items():
            if isinstance(v, _Reset):
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in _REPLACED:
        return base + [v for v in over if v not in base]
    return copy.deepcopy(over)


def _strip_tags(value: Any) -> Any:
    """A file on its own, as the schema sees it (`!reset x` reads as x)."""
    if isinstance(value, dict):
        return {k: _strip_tags(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_tags(v) for v in value]
    if isinstance(value, _Reset):
        return None
    if isinstance(value, _Override):
        return _strip_tags(value.value)
    return value


CONFIGS = {
    "gpu": lambda: load(COMPOSE),
    "cpu": lambda: merge(load(COMPOSE), load(CPU_OVERLAY)),
    "tp": lambda: merge(load(COMPOSE), load(TP_OVERLAY)),
}


@pytest.fixture(params=sorted(CONFIGS))
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    return CONFIGS[request.param]()


def flags(command: list[str]) -> dict[str, str]:
    """`--key=value` / `--key value` pairs of a command line."""
    out: dict[str, str] = {}
    i = 0
    while i < len(command):
        arg = command[i]
        if arg.startswith("--"):
            if "=" in arg:
                k, v = arg[2:].split("=", 1)
            else:
                k, v = arg[2:], command[i + 1] if i + 1 < len(command) else ""
                i += 1
            out[k] = v
        i += 1
    return out


def _port(address: str) -> str:
    return address.rpartition(":")[2]


# ---- the files are valid ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, CPU_OVERLAY, TP_OVERLAY], ids=lambda p: p.name)
def test_each_file_matches_the_compose_schema(path: Path) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator(schema).validate(_strip_tags(load(path)))


def test_merged_model_matches_the_compose_schema(config: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(config)


def test_the_schema_check_catches_a_bad_file() -> None:
    bad = load(COMPOSE)
    bad["services"]["target"]["depends_on"]["draft"]["condition"] = "service_ready"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(bad)


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the `docker compose` plugin is not installed here; the schema checks stand in",
)
@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, CPU_OVERLAY], [COMPOSE, TP_OVERLAY]],
    ids=["gpu", "cpu", "tp"],
)
def test_docker_compose_config_accepts_the_files(files: list[Path]) -> None:
    args = [a for f in files for a in ("-f", str(f))]
    done = subprocess.run(
        ["docker", "compose", *args, "config", "--quiet"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# ---- commands, health, order, ports ------------------------------------------------------------


def test_every_service_runs_specpair_serve_its_role(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == set(ROLES)
    for role, service in services.items():
        assert "entrypoint" not in service, "the image's ENTRYPOINT (specpair) must run"
        assert service["command"][:2] == ["serve", role]
        assert _port(flags(service["command"])["address"]).isdigit()
        assert flags(service["command"])["address"].startswith("0.0.0.0:"), (
            "inside a container the server must listen beyond loopback"
        )


def test_the_image_entrypoint_is_the_specpair_cli() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["specpair"\]$', text, re.M)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["specpair"] == "specpair.cli.main:main"


def test_the_image_carries_every_package_and_the_models() -> None:
    text = DOCKERFILE.read_text()
    copied = {
        src.rstrip("/")
        for line in re.findall(r"^COPY (.+)$", text, re.M)
        for src in shlex.split(line)[:-1]
    }
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in find["packages"]["find"]["include"]}
    assert packages | {"models", "pyproject.toml", "README.md"} <= copied
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not ignored & copied, (
        f".dockerignore hides what the Dockerfile copies: {ignored & copied}"
    )


def test_healthchecks_probe_grpc_health_on_the_service_port(config: dict[str, Any]) -> None:
    for role, service in config["services"].items():
        port = _port(flags(service["command"])["address"])
        test = service["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "specpair.rpc.healthcheck", f"127.0.0.1:{port}"], (
            role
        )
    assert importlib.util.find_spec("specpair.rpc.healthcheck") is not None


def test_start_order_waits_for_health(config: dict[str, Any]) -> None:
    services = config["services"]
    assert services["target"]["depends_on"] == {"draft": {"condition": "service_healthy"}}
    assert services["controller"]["depends_on"] == {"target": {"condition": "service_healthy"}}
    assert "depends_on" not in services["draft"]


def test_services_reach_each_other_by_name(config: dict[str, Any]) -> None:
    services = config["services"]
    draft_port = _port(flags(services["draft"]["command"])["address"])
    target_port = _port(flags(services["target"]["command"])["address"])
    assert flags(services["target"]["command"])["draft"] == f"draft:{draft_port}"
    assert flags(services["controller"]["command"])["target"] == f"target:{target_port}"


def test_grpc_metrics_and_http_ports_are_published_on_loopback(config: dict[str, Any]) -> None:
    published: set[str] = set()
    for role, service in config["services"].items():
        args = flags(service["command"])
        want = {_port(args["address"]), _port(args["metrics-address"])}
        if role == "target":  # the OpenAI-compatible HTTP API, listening beyond loopback inside
            assert args["http-address"].startswith("0.0.0.0:")
            want.add(_port(args["http-address"]))
        ports = {p.rpartition(":")[2]: p for p in service["ports"]}
        assert set(ports) == want, role
        for container_port, spec in ports.items():
            # host IP : host port : container port, same number on both sides
            assert spec == f"127.0.0.1:{container_port}:{container_port}", role
        published |= want
    assert published == {"50051", "50052", "50053", "9451", "9452", "9453", "8000"}


def test_ops_token_comes_from_the_environment(config: dict[str, Any]) -> None:
    for role in ("target", "controller"):
        service = config["services"][role]
        env_name = flags(service["command"])["ops-token-env"]
        assert env_name == "SPECPAIR_OPS_TOKEN"
        assert env_name in service["environment"], role
    target = config["services"]["target"]
    assert target["environment"]["SPECPAIR_API_KEY"] == "${SPECPAIR_API_KEY:-}"


def test_gpu_file_reserves_one_nvidia_gpu_for_the_model_services() -> None:
    services = load(COMPOSE)["services"]
    for role in GPU_ROLES:
        devices = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert flags(services[role]["command"])["device"] == "cuda"
    assert "deploy" not in services["controller"]
    assert services["target"]["build"]["args"]["TORCH_VARIANT"].startswith("${")


def test_cpu_overlay_needs_no_gpu_and_changes_nothing_else() -> None:
    gpu, cpu = load(COMPOSE)["services"], CONFIGS["cpu"]()["services"]
    for role in ROLES:
        assert "deploy" not in cpu[role], role
        assert cpu[role]["build"]["args"]["TORCH_VARIANT"] == "cpu"
        assert cpu[role]["image"] != gpu[role]["image"], "the CPU image must not shadow the GPU one"
        assert cpu[role]["build"]["dockerfile"] == gpu[role]["build"]["dockerfile"]
    for role in GPU_ROLES:
        # Compose replaces `command` whole, so the overlay repeats it: it must differ only here.
        assert flags(cpu[role]["command"])["device"] == "cpu"
        same = [a for a in cpu[role]["command"] if a != "--device=cpu"]
        assert same == [a for a in gpu[role]["command"] if a != "--device=cuda"], role
    assert cpu["controller"]["command"] == gpu["controller"]["command"]


def _gpus(service: dict[str, Any]) -> list[dict[str, Any]]:
    return list(service["deploy"]["resources"]["reservations"]["devices"])


def test_tp_overlay_gives_the_target_a_gpu_per_rank_and_shared_memory() -> None:
    gpu, tp = load(COMPOSE)["services"], CONFIGS["tp"]()["services"]
    target = flags(tp["target"]["command"])
    ranks = int(target["tensor-parallel"])
    assert ranks > 1 and target["device"] == "cuda"  # rank r on cuda:r of the container
    (devices,) = _gpus(tp["target"])  # replaced (`!override`), not appended to `count: 1`
    assert devices == {
        "driver": "nvidia",
        "device_ids": [str(i) for i in range(ranks)],
        "capabilities": ["gpu"],
    }
    assert tp["target"]["shm_size"] == "8gb", "NCCL outgrows the default 64 MiB /dev/shm"
    (draft_gpu,) = _gpus(tp["draft"])
    assert draft_gpu["device_ids"] == ["0"], "the draft beside rank 0, as `specpair up` puts it"
    # Compose replaces `command` whole, so the overlay repeats it: it must differ only here.
    same = [a for a in tp["target"]["command"] if not a.startswith("--tensor-parallel=")]
    assert same == gpu["target"]["command"]
    for role in ("draft", "controller"):
        assert tp[role]["command"] == gpu[role]["command"], role


def test_build_args_pass_through_compose_and_the_build_needs_no_hub() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert not re.search(r"^# *syntax=", dockerfile, re.M), "a syntax line pulls from Docker Hub"
    declared = dict(re.findall(r"^ARG (\w+)=(.*)$", dockerfile, re.M))
    for name, config in (("gpu", load(COMPOSE)), ("cpu", CONFIGS["cpu"]())):
        for role in ROLES:
            args = config["services"][role]["build"]["args"]
            assert {"PYTHON_IMAGE", "TORCH_INDEX", "TORCH_VARIANT"} <= set(args), (name, role)
            assert set(args) <= set(declared), (name, role)
            # compose's default for the base image is the Dockerfile's (one value, said twice)
            assert args["PYTHON_IMAGE"] == f"${{SPECPAIR_PYTHON_IMAGE:-{declared['PYTHON_IMAGE']}}}"
            assert args["TORCH_INDEX"] == "${SPECPAIR_TORCH_INDEX:-}"
    # An empty TORCH_INDEX (compose's default) falls back to TORCH_VARIANT's index.
    assert declared["TORCH_INDEX"] == '""'
    assert "${TORCH_INDEX:-https://download.pytorch.org/whl/${TORCH_VARIANT}}" in dockerfile


def test_the_compose_version_needed_is_stated() -> None:
    for path in (COMPOSE, CPU_OVERLAY, TP_OVERLAY, ROOT / "README.md"):
        assert re.search(r"Compose v?2\.24\.4", path.read_text()), path


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        # docker without the Compose v2 plugin: `compose` is no command, the flag is refused
        ('echo "unknown flag: --short" >&2; exit 125', "Docker Compose v2"),
        ("echo v2.20.3", "Docker Compose 2.20.3 is older than 2.24.4"),
    ],
)
def test_the_smoke_script_says_which_compose_it_needs(
    tmp_path: Path, answer: str, said: str
) -> None:
    fake = tmp_path / "docker"  # answers `docker compose version --short`; runs nothing else
    fake.write_text(f'#!/bin/sh\n[ "$1 $2" = "compose version" ] || exit 99\n{answer}\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    done = subprocess.run(
        ["bash", str(ROOT / "docker" / "compose_smoke.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "2.24.4" in done.stderr, done.stderr
    assert "unknown flag" not in done.stderr


def test_merge_follows_compose_rules() -> None:
    base = {"a": {"command": ["x"], "ports": ["1"], "deploy": {"r": 1}, "env": {"A": "1"}}}
    over = {"a": {"command": ["y"], "ports": ["2"], "deploy": _Reset(), "env": {"B": "2"}}}
    assert merge(base, over) == {
        "a": {"command": ["y"], "ports": ["1", "2"], "env": {"A": "1", "B": "2"}}
    }


# ---- the command lines parse with the real CLI -------------------------------------------------


def _parser() -> Any:
    if importlib.util.find_spec("specpair.cli.main") is None:
        pytest.skip(
            "specpair/cli/main.py does not exist yet (being written); cannot parse commands"
        )
    from specpair.cli import main as cli

    assert hasattr(cli, "build_parser"), (
        "specpair.cli.main must expose build_parser() for this check"
    )
    return cli.build_parser()


def test_every_command_parses_with_the_real_cli(config: dict[str, Any]) -> None:
    parser = _parser()
    for role, service in config["services"].items():
        try:
            parser.parse_args(service["command"])
        except SystemExit as e:  # argparse has printed why on stderr
            pytest.fail(f"{role}: `specpair {' '.join(service['command'])}` rejected ({e})")


# ---- the health probe itself -------------------------------------------------------------------


async def test_healthcheck_reports_serving_only_once_ready() -> None:
    server = GrpcServer(ServerConfig(address="127.0.0.1:0"), ["specpair.v1.TargetService"])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        # The probe is blocking (it runs as its own process in the container): run it off-loop.
        probe = healthcheck.main
        assert await _in_thread(probe, [address, "--timeout", "2"]) == 1  # NOT_SERVING
        await server.ready()
        assert await _in_thread(probe, [address, "--timeout", "2"]) == 0
        assert await _in_thread(probe, [address, "--service", "specpair.v1.TargetService"]) == 0
        assert await _in_thread(probe, [address, "--service", "nope", "--timeout", "2"]) == 1
    finally:
        await server.stop(0)
    assert await _in_thread(healthcheck.main, [address, "--timeout", "1"]) == 1  # unreachable


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def kernel_caches() -> dict[str, str]:
    """The image's FLASHINFER_WORKSPACE_BASE and TRITON_CACHE_DIR (its ENV lines)."""
    text = DOCKERFILE.read_text()
    return {
        name: re.search(rf"\b{name}=(\S+)", text).group(1)  # type: ignore[union-attr]
        for name in ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR")
    }


def test_the_gpu_kernels_compiled_at_start_up_outlive_the_containers(
    config: dict[str, Any],
) -> None:
    # flashinfer and Triton compile on first use (the warm-up before SERVING): both caches lie
    # on one named volume, which a restart or `up --build` keeps.
    caches = kernel_caches()
    for role in GPU_ROLES:
        mounts = [v.split(":") for v in config["services"][role]["volumes"]]
        (volume, path) = next((v, p) for v, p in mounts if caches["TRITON_CACHE_DIR"].startswith(p))
        assert volume in config["volumes"], f"{role}: {volume} is no named volume"
        assert all(Path(c).is_relative_to(path) for c in caches.values()), (role, caches)
    assert "chown -R specpair /var/cache/specpair" in DOCKERFILE.read_text()  # writable
