"""`specpair serve` options generated from the config dataclasses' fields.

A field with `help` in its metadata is an option: `--max-len` for `max_len` unless `flag` names
another; `env` names a variable that overrides the command's default, `cli_default` gives the
command a default other than the library's, `off_flag` adds a switch that sets the field to
None (`--no-draft`), `secret` keeps its value (from `env`) out of --help. The field's type
gives the parser: an enum becomes choices, a tuple of ints a comma-separated list, a tuple of
strings a repeatable option.

A field with `lab` metadata is no option: `lab_values` reads it from its `SPECPAIR_LAB_`
variable (`config.option.lab_variable`), once, where `serve` builds the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from pathlib import Path
from typing import Any

from specpair.config import DEFAULT_METRICS, ServerConfig, TLSConfig, env_address
from specpair.config.option import lab_variable


def steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _options(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if "help" in f.metadata]


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def _parser_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    """(argparse type, extra add_argument kwargs) of a field type; Optional is unwrapped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint, {"choices": list(hint)}
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return (steps, {}) if item is int else (item, {"action": "append"})
    if hint in (int, float, str, Path):
        return hint, {}
    if hint is bool:  # a switch, off by default
        return None, {"action": "store_true"}
    raise TypeError(f"no option type for {hint!r}")


def _default(f: dataclasses.Field[Any]) -> Any:
    default = f.metadata.get("cli_default", f.default)
    env = f.metadata.get("env")
    if env and (value := os.environ.get(str(env))) is not None:
        return value
    return default


def add_config_options(parser: argparse.ArgumentParser, cls: type) -> None:
    for f, hint in _options(cls):
        kind, extra = _parser_type(hint)
        default = _default(f)
        text = str(f.metadata["help"])
        if extra.get("action") == "append":
            # argparse appends to a list default: the default is applied after parsing.
            parser.add_argument(_flag(f), dest=f.name, type=kind, default=None, help=text, **extra)
            continue
        if extra.get("action") == "store_true":
            parser.add_argument(_flag(f), dest=f.name, help=text, **extra)
            continue
        required = f.default is dataclasses.MISSING and "cli_default" not in f.metadata
        if not required and default not in (None, "") and not f.metadata.get("secret"):
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
            text += f" (default: {shown})"
        metavar = None if "choices" in extra else _flag(f)[2:].upper().replace("-", "_")
        parser.add_argument(
            _flag(f),
            dest=f.name,
            type=kind,
            required=required,
            metavar=metavar,
            default=None if required else default,
            help=text,
            **extra,
        )
        if off := f.metadata.get("off_flag"):
            parser.add_argument(
                str(off), dest=f"{f.name}_off", action="store_true", help=f.metadata["off_help"]
            )


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed options of `cls`'s fields, as its constructor takes them."""
    values: dict[str, Any] = {}
    for f, _ in _options(cls):
        value = getattr(args, f.name)
        if getattr(args, f"{f.name}_off", False):
            value = None
        elif isinstance(f.default, tuple) and isinstance(value, list | type(None)):
            value = tuple(value) if value else _tuple_default(f)
        values[f.name] = value
    return values


def lab_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """`cls`'s lab switches (`config.option.lab`)."""
    return [f for f in dataclasses.fields(cls) if "lab" in f.metadata]


def lab_epilog(cls: type) -> str | None:
    """The line `serve --help` ends with where `cls` has lab switches: their variables."""
    names = [lab_variable(f.name) for f in lab_fields(cls)]
    if not names:
        return None
    return f"lab switches (measuring only; ARCHITECTURE.md, 'Lab switches'): {', '.join(names)}"


TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def lab_values(cls: type, environ: typing.Mapping[str, str] | None = None) -> dict[str, Any]:
    """The lab switches of `cls` set in `environ` (default: this process's environment), as
    its constructor takes them; ValueError names the variable of a value that does not parse."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in lab_fields(cls):
        variable = lab_variable(f.name)
        if (text := environ.get(variable)) is None:
            continue
        kind = hints[f.name]
        if kind is bool:
            if text.strip().lower() not in TRUE + FALSE:
                raise ValueError(f"{variable}: expected 1 or 0, got {text!r}")
            values[f.name] = text.strip().lower() in TRUE
            continue
        number = float if float in typing.get_args(kind) or kind is float else int
        try:
            values[f.name] = number(text)
        except ValueError:
            raise ValueError(f"{variable}: expected a number, got {text!r}") from None
    return values


def _tuple_default(f: dataclasses.Field[Any]) -> tuple[Any, ...]:
    env = f.metadata.get("env")
    if env and (value := os.environ.get(str(env))):
        return (value,)
    return tuple(f.default)  # type: ignore[arg-type]


TOKEN_ENV = "SPECPAIR_OPS_TOKEN"
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def add_server_options(p: argparse.ArgumentParser, service: str) -> None:
    """ServerConfig's options; the defaults are the service's (SPECPAIR_<SERVICE>_…)."""
    p.add_argument(
        "--address",
        default=env_address(service),
        help="HOST:PORT (or unix:PATH) to bind (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-address",
        default=os.environ.get(f"SPECPAIR_{service.upper()}_METRICS", DEFAULT_METRICS[service]),
        help="HOST:PORT for Prometheus /metrics ('' disables; default: %(default)s)",
    )
    p.add_argument(
        "--ops-token-env",
        default=TOKEN_ENV,
        help="env var holding the ops token (default: %(default)s)",
    )
    p.add_argument("--tls-cert", type=Path, help="PEM certificate (enables TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--tls-ca", type=Path, help="PEM CA for verifying peers")
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="least severe log lines written (default: %(default)s)",
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        address=args.address,
        metrics_address=args.metrics_address,
        ops_token=os.environ.get(args.ops_token_env) or None,
        tls=TLSConfig(args.tls_cert, args.tls_key, args.tls_ca),
    )
