"""The `specpair` command: serve one service, bring all three up, generate, chat, ops (`ctl`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tomllib
from collections.abc import Callable, Coroutine, Sequence
from importlib import metadata
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from specpair.cli.options import (
    TOKEN_ENV,
    add_config_options,
    add_server_options,
    config_values,
    lab_epilog,
    lab_fields,
    lab_values,
    server_config,
)
from specpair.config import (
    ControllerConfig,
    DraftConfig,
    DraftKind,
    FeatureDType,
    ModelServiceConfig,
    TargetConfig,
)

SERVICE_CONFIGS: dict[str, type[TargetConfig | DraftConfig | ControllerConfig]] = {
    "target": TargetConfig,
    "draft": DraftConfig,
    "controller": ControllerConfig,
}
SERVICE_HELP = {
    "target": "the target service (front door)",
    "draft": "the draft service",
    "controller": "the adaptive controller + ops API",
}
# Each service package registers its `serve(config)` here (pyproject.toml), so this package
# names none of them: dependencies point from the services to `specpair`, never back.
SERVICES_GROUP = "specpair.services"
# ... and, where it reads more than its flags (the controller: its policy file), a
# `preflight(config)` that raises ValueError naming what is wrong, before anything loads.
PREFLIGHT_GROUP = "specpair.preflight"


def _client_tls_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", type=Path, help="PEM CA that signed the server's certificate")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (servers given a CA)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def _generation_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="target HOST:PORT (default: $SPECPAIR_TARGET_ADDRESS or 127.0.0.1:50051)",
    )
    p.add_argument(
        "--max-tokens", type=int, help="tokens to generate at most (default: 16, the server's)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0: off (default: %(default)s)")
    p.add_argument("--seed", type=int, help="seed of a sampled request (reproducible output)")
    p.add_argument("--stop", action="append", help="stop string (repeatable, at most 4)")
    p.add_argument("--json", action="store_true", help="print the GenerateResult as JSON")
    p.add_argument(
        "--api-key-env",
        default="SPECPAIR_API_KEY",
        help="env var holding the target's API key, sent as 'authorization: Bearer KEY' "
        "(default: %(default)s)",
    )
    _client_tls_opts(p)


def version() -> str:
    """The installed package's version, or the checkout's pyproject.toml's (no metadata)."""
    try:
        return metadata.version("specpair")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpair", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specpair {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service").add_subparsers(
        dest="service", required=True
    )
    for name, cls in SERVICE_CONFIGS.items():
        service = serve.add_parser(name, help=SERVICE_HELP[name], epilog=lab_epilog(cls))
        add_server_options(service, name)
        add_config_options(service, cls)

    up = sub.add_parser("up", help="run target, draft and controller locally")
    up.add_argument("--target-model", type=Path, help="default: models/target (or a tiny pair)")
    up.add_argument("--draft-model", type=Path, help="default: models/draft")
    up.add_argument(
        "--draft-kind",
        type=DraftKind,
        choices=list(DraftKind),
        default="model",
        help="draft with a small LM or an EAGLE head (default: %(default)s)",
    )
    up.add_argument(
        "--draft-token-map",
        type=Path,
        metavar="FILE",
        help="the ids an EAGLE-1/2 head drafts over (`serve draft --token-map`)",
    )
    up.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: %(default)s)")
    up.add_argument("--draft-device", help="the draft's device (default: --device), e.g. cuda:1")
    up.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="split the target over N ranks (default: %(default)s); on CUDA one GPU a rank, "
        "from --device's on: cuda:K … cuda:K+N-1, the draft on cuda:K unless --draft-device",
    )
    up.add_argument(
        "--max-batch",
        type=int,
        metavar="N",
        help="requests the target decodes together (`serve target --max-batch`; default: 64 on "
        "a GPU, 16 on the CPU); each batch bucket up to it has its graphs built at start-up, "
        "and the KV cache holds N x max_len tokens: lower it where GPU memory is short",
    )
    up.add_argument(
        "--feature-dtype",
        choices=[d.value for d in FeatureDType],
        default=FeatureDType.AUTO.value,
        help="how EAGLE features travel to the draft (`serve target --feature-dtype`): auto, "
        "as computed; float8, half bfloat16's bytes (drafts change slightly, outputs do not; "
        "at 64 clients it halved the hand-off's time; default: %(default)s)",
    )
    up.add_argument(
        "--feature-ring-mib",
        type=int,
        metavar="MIB",
        help="the target's buffer that the draft maps to read EAGLE features by reference "
        "(`serve target --feature-ring-mib`; default: the target's, 0: features as bytes)",
    )
    up.add_argument(
        "--draft-window",
        type=int,
        metavar="N",
        help="tokens of a request's history the draft is sent when it starts the request "
        "(`serve target --draft-window`; default: 32 with an EAGLE head on a GPU, else the "
        "target's, 0: the whole history)",
    )
    up.add_argument(
        "--deterministic",
        action="store_true",
        help="the target's batch-invariant mode (CUDA; see `serve target --help`)",
    )
    up.add_argument(
        "--tree-shapes",
        action="append",
        default=[],
        metavar="SHAPE",
        help="build a tree-shaped tier on the target and the draft, e.g. 4x4x16 (repeat for "
        "more; default: none); `ctl pin` it, or list it in a goodput policy's "
        "tree_shapes",
    )
    up.add_argument("--policy", type=Path, help="the controller's policy JSON file")
    up.add_argument("--demo", action="store_true", help="run the demo client once it is up")

    gen = sub.add_parser("generate", help="generate from a running target")
    gen.add_argument("prompt", help="the prompt text")
    _generation_opts(gen)

    chat = sub.add_parser(
        "chat", help="chat with a running target (its checkpoint's chat template)"
    )
    chat.add_argument("message", nargs="?", help="one turn; without it, an interactive loop")
    chat.add_argument("--system", help="a system message before the conversation")
    _generation_opts(chat)

    ctl = sub.add_parser("ctl", help="controller ops: status, pin, unpin, policy")
    ctl.add_argument(
        "--address",
        default=None,
        help="controller HOST:PORT (default: $SPECPAIR_CONTROLLER_ADDRESS or 127.0.0.1:50053)",
    )
    ctl.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        help="env var holding the ops token (default: %(default)s)",
    )
    _client_tls_opts(ctl)
    ops = ctl.add_subparsers(dest="op", required=True)
    status = ops.add_parser("status", help="state of every target")
    status.add_argument("--json", action="store_true", help="the state as JSON (for scripts)")
    pin = ops.add_parser("pin", help="pin a tier (overrides the policy)")
    pin.add_argument(
        "tier",
        help="the tier, a candidate: a chain's speculative_num_steps (7) "
        "or a tree shape STEPSxTOPKxNUM_DRAFT_TOKENS (4x4x16)",
    )
    ops.add_parser("unpin", help="hand the tier back to the policy")
    policy = ops.add_parser("policy", help="update policy keys live: KEY=VALUE …")
    policy.add_argument(
        "changes",
        nargs="+",
        metavar="KEY=VALUE",
        help="a policy key and its value (JSON, or a bare string)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TargetConfig | DraftConfig | ControllerConfig:
    """Validated service config for `serve`; raises ValueError with the offending option."""
    cls = SERVICE_CONFIGS[args.service]
    return cls(server_config(args), **config_values(args, cls), **lab_values(cls))


def _service_entry(
    service: str, group: str = SERVICES_GROUP, *, required: bool = True
) -> Callable[[Any], Any] | None:
    """What `service` registered under `group`; None where it registered nothing and the entry
    is not `required`."""
    # A source checkout (run through PYTHONPATH on a GPU machine with no installer, or installed
    # editable) names its entries in its own pyproject.toml, which is the code that runs: the
    # installed metadata may be another checkout's, or older than a group or a module's move.
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    table: dict[str, str] = {}
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        table = project.get("entry-points", {}).get(group, {})
    if service in table:
        return EntryPoint(service, table[service], group).load()  # type: ignore[no-any-return]
    found = entry_points(group=group, name=service)
    if found:
        return next(iter(found)).load()  # type: ignore[no-any-return]
    if not required:
        return None
    raise RuntimeError(
        f"no {service!r} service registered under the {group!r} entry points: "
        "install the package (pip install -e .) so its metadata lists them"
    )


def preflight(args: argparse.Namespace) -> TargetConfig | DraftConfig | ControllerConfig:
    """`serve`'s config, checked as far as it can be before anything loads (`specpair up` checks
    all three before starting one): ValueError names the option, directory or key at fault."""
    config = config_from_args(args)
    if isinstance(config, TargetConfig | DraftConfig) and not config.model_path.is_dir():
        raise ValueError(f"--model {config.model_path}: no such checkpoint directory")
    if isinstance(config, TargetConfig) and config.tensor_parallel > 1 and config.device != "cpu":
        import torch  # the ranks' GPUs: only a CUDA tensor-parallel target pays for the import

        config.check_gpus(torch.cuda.device_count())
    check = _service_entry(args.service, PREFLIGHT_GROUP, required=False)
    if check is not None:
        check(config)
    return config


async def _serve(service: Callable[[Any], Coroutine[Any, Any, None]], config: Any) -> None:
    # SIGTERM (docker stop, `specpair up` shutting down) stops gracefully, like Ctrl-C.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    await service(config)


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.logging import configure_logging
    from specpair.models.loading import CheckpointError
    from specpair.parallel.ranks import RankExitedError
    from specpair.rpc.serving import BindError

    try:
        config = preflight(args)
        service = _service_entry(args.service)
    except ValueError as exc:  # a bad policy file is one line too, not a traceback
        print(f"{parser.prog} serve {args.service}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"{parser.prog} serve {args.service}: error: {exc}", file=sys.stderr)
        return 1
    assert service is not None  # required
    configure_logging(args.service, level=args.log_level)
    from specpair.rpc.host_memory import keep_freed_memory

    keep_freed_memory()
    from specpair.rpc.gc_heap import freeze_when_serving

    freezing = isinstance(config, ModelServiceConfig) and not config.no_gc_freeze
    # a measuring switch: say so, from the config (the environment was read into it once)
    fields = lab_fields(type(config))  # bools and numbers, each with a plain default
    if labs := {f.name: v for f in fields if (v := getattr(config, f.name)) != f.default}:
        from specpair.logging import get_logger

        get_logger(__name__).warning("lab switches set", **labs)
    try:
        frozen = freeze_when_serving() if freezing else contextlib.nullcontext()
        with frozen, contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
            asyncio.run(_serve(service, config))
    except (BindError, CheckpointError, RankExitedError) as exc:  # one line, no traceback
        print(f"{parser.prog} serve {args.service}: error: {exc}", file=sys.stderr)
        if isinstance(exc, RankExitedError):
            # A hung rank may hold the compute thread inside a collective for good (NCCL does
            # not fail it when the peer is killed), and the interpreter's exit joins it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 1
    from specpair.parallel.ranks import exit_if_nccl

    exit_if_nccl(0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args, parser)
    if args.command == "up":
        from specpair.cli.launcher import run_up

        return run_up(args, lambda argv: preflight(parser.parse_args(["serve", *argv])))
    from specpair.cli import client_commands

    if args.command == "generate":
        return client_commands.cmd_generate(args, parser)
    if args.command == "chat":
        return client_commands.cmd_chat(args, parser)
    return client_commands.cmd_ctl(args, parser)
