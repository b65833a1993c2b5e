"""`specpair generate`, `chat` and `ctl`: the SDK behind the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from specpair.config import TLSConfig

if TYPE_CHECKING:
    from specpair.client.results import ControllerState
    from specpair.target_state import TargetState


def client_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TLSConfig:
    try:
        return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        parser.error(str(exc))


def _generation_params(args: argparse.Namespace) -> dict[str, Any]:
    """The request's parameters, checked offline as the SDK checks them (ValueError names the
    field: `--max-tokens 0` would otherwise reach the wire as unset, the server's 16)."""
    from specpair.client.requests import build_generate_request

    params: dict[str, Any] = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    params |= {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    build_generate_request("", **params)
    return params


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

    try:
        params = _generation_params(args)
    except ValueError as exc:
        print(f"{parser.prog} generate: error: {exc}", file=sys.stderr)
        return 2  # a usage error, as argparse exits for its own
    client = SpecpairClient(
        args.address, tls=client_tls(args, parser), api_key=os.environ.get(args.api_key_env)
    )
    try:
        if args.json:
            print(json.dumps(client.generate(args.prompt, **params).to_dict(), indent=2))
        else:
            _print_stream(client.stream(args.prompt, **params))
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


CHAT_ENDS = "Ctrl-D or /exit ends the chat"


def _read_turns() -> Iterator[str]:
    """User turns from the terminal (or a pipe) until EOF (Ctrl-D) or /exit; blank lines are
    skipped."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip() == "/exit":
            return
        if line.strip():
            yield line


def cmd_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specpair.client import SpecpairClient, SpecpairError

    try:
        params = _generation_params(args)
    except ValueError as exc:
        print(f"{parser.prog} chat: error: {exc}", file=sys.stderr)
        return 2
    client = SpecpairClient(
        args.address, tls=client_tls(args, parser), api_key=os.environ.get(args.api_key_env)
    )
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is None:  # on stderr: stdout is the conversation
        print(f"specpair chat with {client.address}: {CHAT_ENDS}", file=sys.stderr, flush=True)
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
    except KeyboardInterrupt:  # Ctrl-C, at the prompt or mid-reply (its stream is cancelled)
        print(file=sys.stderr)
        return 130  # the shell's code for an interrupted command
    finally:
        client.close()
    if args.message is None:
        print(file=sys.stderr)  # the prompt's line, ended
    return 0


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def policy_changes(items: Sequence[str]) -> dict[str, Any]:
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
    from specpair.cli.launcher import stored_ops_token
    from specpair.client import ControllerClient, SpecpairError, build_pin

    try:
        changes = policy_changes(args.changes) if args.op == "policy" else {}
        if args.op == "pin":
            build_pin(args.tier)  # a tier that is none fails here, offline
    except ValueError as exc:
        print(f"{parser.prog} ctl {args.op}: error: {exc}", file=sys.stderr)
        return 2  # a usage error, as argparse exits for its own
    tls = client_tls(args, parser)
    # without one set, the token `specpair up` made for its group
    token = os.environ.get(args.token_env) or stored_ops_token()
    client = ControllerClient(args.address, token=token, tls=tls)
    try:
        result: dict[str, Any]
        if args.op == "status" and not args.json:
            print(status_table(client.state()))
            return 0
        if args.op == "status":
            result = client.state().to_dict()
        elif args.op == "pin":  # one line: `ctl status` shows the rest
            print(f"pinned tier {args.tier} on {_targets_named(client.pin(args.tier))}")
            return 0
        elif args.op == "unpin":
            print(f"unpinned {_targets_named(client.unpin())}: the policy picks the tier again")
            return 0
        else:
            result = {"policy": client.update_policy(**changes)}
    except SpecpairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


def _targets_named(targets: Sequence[TargetState], most: int = 3) -> str:
    """ "1 target (127.0.0.1:50051)", "5 targets (a, b, c, …)"."""
    names = [t.target_address for t in targets[:most]] + ["…"] * (len(targets) > most)
    return f"{len(targets)} target{'s' * (len(targets) != 1)} ({', '.join(names)})"


def status_table(state: ControllerState) -> str:
    """`specpair ctl status` for a person: the policy on one line, a row per target, then each
    target's estimates, model and recent switches (`--json` gives everything, for scripts).

        policy: goodput  candidate_steps=[0, 1, 3, 7]  tree_shapes=["4x4x16"]  …
        target            connected  tier    pinned  EMA   rounds
        127.0.0.1:50051   yes        4x4x16  -       3.91  120
          round 51: 3 → 4x4x16 (policy, EMA 2.51)
    """
    policy = dict(state.policy)
    kind = policy.pop("kind", "?")
    if not policy.get("tree_shapes", True):
        del policy["tree_shapes"]  # a kind of chains only
    lines = [f"policy: {kind}  " + "  ".join(f"{k}={_short(v)}" for k, v in policy.items())]
    rows = [("target", "connected", "tier", "pinned", "EMA", "rounds")]
    for t in state.targets:
        rows.append(
            (
                t.target_address,
                "yes" if t.connected else "no",
                t.active_tier,
                t.pinned_tier or "-",
                f"{t.ema:.2f}",
                str(t.rounds_seen),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            continue
        target = state.targets[i - 1]
        for e in target.estimates:
            lines.append(
                f"  tier {e.tier}: {e.tokens_per_s:.0f} tok/s predicted, {e.round_ms:.1f} ms "
                f"a round ({e.observed_rounds} rounds measured)"
            )
        if target.model:
            lines.append(f"  {target.model}")
        for s in target.recent_switches:
            lines.append(
                f"  round {s.round_id}: {s.from_tier} → {s.to_tier} ({s.reason}, EMA {s.ema:.2f})"
            )
    if not state.targets:
        lines.append("(no targets)")
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | tuple) else str(value)
    return text if len(text) <= 60 else text[:59] + "…"
