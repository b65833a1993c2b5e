"""The `specpair` command: serve one service, bring all three up, generate, chat, ops (`ctl`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specpair.config import (
    CANDIDATE_STEPS,
    DEFAULT_METRICS,
    ControllerConfig,
    DraftConfig,
    ServerConfig,
    TargetConfig,
    TLSConfig,
    env_address,
    env_http_address,
)

TOKEN_ENV = "SPECPAIR_OPS_TOKEN"


def _steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _common(p: argparse.ArgumentParser, service: str) -> None:
    p.add_argument(
        "--address", default=env_address(service), help="HOST:PORT (or unix:PATH) to bind"
    )
    p.add_argument(
        "--metrics-address",
        default=os.environ.get(f"SPECPAIR_{service.upper()}_METRICS", DEFAULT_METRICS[service]),
        help="HOST:PORT for Prometheus /metrics ('' disables)",
    )
    p.add_argument("--ops-token-env", default=TOKEN_ENV, help="env var holding the ops token")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate (enables TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--tls-ca", type=Path, help="PEM CA for verifying peers")
    p.add_argument("--log-level", default="INFO")


def _model_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--candidate-steps", type=_steps, default=CANDIDATE_STEPS)
    p.add_argument("--max-len", type=int, default=1024, help="context length served")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU default)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: half the cores)")
    p.add_argument(
        "--busy-poll-ms", type=float, default=None,
        help="poll for the peer's next message this long before sleeping (20 on CUDA, 0 on CPU)",
    )  # fmt: skip


def _client_tls_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", type=Path, help="PEM CA that signed the server's certificate")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate (servers given a CA)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")


def _client_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TLSConfig:
    try:
        return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        parser.error(str(exc))


def _generation_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="target HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print the GenerateResult as JSON")
    _client_tls_opts(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpair", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service").add_subparsers(
        dest="service", required=True
    )
    target = serve.add_parser("target", help="the target service (front door)")
    _common(target, "target")
    _model_opts(target)
    target.add_argument("--model", type=Path, required=True, help="target checkpoint directory")
    target.add_argument(
        "--draft", default=env_address("draft"), help="draft service HOST:PORT or unix:PATH"
    )
    target.add_argument("--no-draft", action="store_true", help="decode without speculation")
    target.add_argument("--initial-steps", type=int, default=3)
    target.add_argument("--max-batch", type=int, default=16)
    target.add_argument("--max-queue", type=int, default=256)
    target.add_argument("--draft-timeout", type=float, default=5.0, help="seconds per round")
    target.add_argument(
        "--http-address",
        default=env_http_address(),
        help="HOST:PORT of the OpenAI-compatible HTTP API ('' disables)",
    )

    draft = serve.add_parser("draft", help="the draft service")
    _common(draft, "draft")
    _model_opts(draft)
    draft.add_argument("--model", type=Path, required=True, help="draft LM or EAGLE head dir")
    draft.add_argument("--draft-kind", choices=["model", "eagle"], default="model")
    draft.add_argument("--target-model", type=Path, help="target checkpoint (EAGLE only)")
    draft.add_argument("--max-requests", type=int, default=64)

    ctrl = serve.add_parser("controller", help="the adaptive controller + ops API")
    _common(ctrl, "controller")
    ctrl.add_argument(
        "--target",
        action="append",
        help="target HOST:PORT (repeatable; default: $SPECPAIR_TARGET_ADDRESS)",
    )
    ctrl.add_argument("--policy", type=Path, help="policy JSON file (omitted keys: defaults)")
    ctrl.add_argument(
        "--state-file",
        type=Path,
        default=os.environ.get("SPECPAIR_CONTROLLER_STATE") or None,
        help="JSON file keeping the pin, the live policy and each target's EMA across restarts",
    )

    up = sub.add_parser("up", help="run target, draft and controller locally")
    up.add_argument("--target-model", type=Path, help="default: models/target (or a tiny pair)")
    up.add_argument("--draft-model", type=Path, help="default: models/draft")
    up.add_argument("--draft-kind", choices=["model", "eagle"], default="model")
    up.add_argument("--device", default="cpu")
    up.add_argument("--policy", type=Path)
    up.add_argument("--demo", action="store_true", help="run the demo client once it is up")

    gen = sub.add_parser("generate", help="generate from a running target")
    gen.add_argument("prompt")
    _generation_opts(gen)

    chat = sub.add_parser(
        "chat", help="chat with a running target (its checkpoint's chat template)"
    )
    chat.add_argument("message", nargs="?", help="one turn; without it, an interactive loop")
    chat.add_argument("--system", help="a system message before the conversation")
    _generation_opts(chat)

    ctl = sub.add_parser("ctl", help="controller ops: status, pin, unpin, policy")
    ctl.add_argument("--address", default=None, help="controller HOST:PORT")
    ctl.add_argument("--token-env", default=TOKEN_ENV)
    _client_tls_opts(ctl)
    ops = ctl.add_subparsers(dest="op", required=True)
    ops.add_parser("status", help="state of every target")
    pin = ops.add_parser("pin", help="pin a tier (overrides the policy)")
    pin.add_argument("steps", type=int)
    ops.add_parser("unpin", help="hand the tier back to the policy")
    policy = ops.add_parser("policy", help="update policy keys live: KEY=VALUE …")
    policy.add_argument("changes", nargs="+", metavar="KEY=VALUE")
    return parser


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        address=args.address,
        metrics_address=args.metrics_address,
        ops_token=os.environ.get(args.ops_token_env) or None,
        tls=TLSConfig(args.tls_cert, args.tls_key, args.tls_ca),
    )


def _dtype(args: argparse.Namespace) -> str:
    return args.dtype or ("float32" if args.device == "cpu" else "bfloat16")


def config_from_args(args: argparse.Namespace) -> TargetConfig | DraftConfig | ControllerConfig:
    """Validated service config for `serve`; raises ValueError with the offending option."""
    server = _server_config(args)
    if args.service == "target":
        return TargetConfig(
            server=server,
            model_path=args.model,
            draft_address=None if args.no_draft else args.draft,
            candidate_steps=args.candidate_steps,
            initial_steps=args.initial_steps,
            max_batch=args.max_batch,
            max_len=args.max_len,
            max_queue=args.max_queue,
            draft_timeout_s=args.draft_timeout,
            device=args.device,
            dtype=_dtype(args),
            threads=args.threads,
            busy_poll_ms=args.busy_poll_ms,
            http_address=args.http_address,
        )
    if args.service == "draft":
        return DraftConfig(
            server=server,
            model_path=args.model,
            draft_kind=args.draft_kind,
            target_path=args.target_model,
            candidate_steps=args.candidate_steps,
            max_requests=args.max_requests,
            max_len=args.max_len + max(args.candidate_steps),
            device=args.device,
            dtype=_dtype(args),
            threads=args.threads,
            busy_poll_ms=args.busy_poll_ms,
        )
    return ControllerConfig(
        server=server,
        targets=tuple(args.target or [env_address("target")]),
        policy_file=args.policy,
        state_file=args.state_file,
    )


async def _serve(config: Any) -> None:
    # SIGTERM (docker stop, `specpair up` shutting down) stops gracefully, like Ctrl-C.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    if isinstance(config, TargetConfig):
        from target_service.server import serve as serve_target

        await serve_target(config)
    elif isinstance(config, DraftConfig):
        from draft_service.server import serve as serve_draft

        await serve_draft(config)
    else:
        from controller.server import serve as serve_controller

        await serve_controller(config)


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.logging import configure_logging
    from specpair.models.loading import CheckpointError
    from specpair.serving import BindError

    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if isinstance(config, TargetConfig | DraftConfig) and not config.model_path.is_dir():
        parser.error(f"--model {config.model_path}: no such checkpoint directory")
    configure_logging(args.service, level=args.log_level)
    try:
        with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
            asyncio.run(_serve(config))
    except (BindError, CheckpointError) as exc:  # the user's to fix: one line, no traceback
        print(f"{parser.prog} serve {args.service}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _generation_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }


def _print_stream(deltas: Iterator[Any]) -> str:
    """Writes the deltas' text as it arrives; returns all of it."""
    parts = []
    for delta in deltas:
        parts.append(delta.text)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(parts)


def cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.client import SpecpairClient, SpecpairError

    client = SpecpairClient(args.address, tls=_client_tls(args, parser))
    params = _generation_params(args)
    try:
        if args.json:
            print(json.dumps(client.generate(args.prompt, **params).to_dict(), indent=2))
        else:
            _print_stream(client.stream(args.prompt, **params))
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _read_turns() -> Iterator[str]:
    """User turns from the terminal (or a pipe) until EOF or an empty line."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def cmd_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.client import SpecpairClient, SpecpairError

    client = SpecpairClient(args.address, tls=_client_tls(args, parser))
    params = _generation_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.message] if args.message is not None else _read_turns()
    try:
        for turn in turns:
            history.append({"role": "user", "content": turn})
            if args.json:
                result = client.chat(history, **params)
                print(json.dumps(result.to_dict(), indent=2))
                reply = result.text
            else:
                reply = _print_stream(client.stream_chat(history, **params))
            history.append({"role": "assistant", "content": reply})
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _policy_changes(items: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` arguments as typed changes; ValueError names the bad one."""
    from specpair.client import build_policy_update

    changes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy change {item!r} must be KEY=VALUE")
        changes[key] = _parse_value(value)
    build_policy_update(**changes)  # unknown keys and mistyped values fail here, offline
    return changes


def cmd_ctl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.client import ControllerClient, SpecpairError

    try:
        changes = _policy_changes(args.changes) if args.op == "policy" else {}
    except ValueError as exc:
        print(f"{parser.prog} ctl policy: error: {exc}", file=sys.stderr)
        return 2  # a usage error, as argparse exits for its own
    tls = _client_tls(args, parser)
    client = ControllerClient(args.address, token=os.environ.get(args.token_env), tls=tls)
    try:
        result: dict[str, Any]
        if args.op == "status":
            result = client.state().to_dict()
        elif args.op == "pin":
            result = {"targets": [t.to_dict() for t in client.pin(args.steps)]}
        elif args.op == "unpin":
            result = {"targets": [t.to_dict() for t in client.unpin()]}
        else:
            result = {"policy": client.update_policy(**changes)}
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args, parser)
    if args.command == "up":
        from specpair.launcher import run_up

        return run_up(args)
    if args.command == "generate":
        return cmd_generate(args, parser)
    if args.command == "chat":
        return cmd_chat(args, parser)
    return cmd_ctl(args, parser)


if __name__ == "__main__":
    sys.exit(main())
