"""`specpair generate`, `chat` and `ctl`: the SDK behind the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from specpair.config import TLSConfig


def client_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TLSConfig:
    try:
        return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        parser.error(str(exc))


def _generation_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    return params | {
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

    client = SpecpairClient(args.address, tls=client_tls(args, parser))
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

    client = SpecpairClient(args.address, tls=client_tls(args, parser))
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
    tls = client_tls(args, parser)
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
