"""Service addresses: the defaults, the environment variables over them, and their checks."""

from __future__ import annotations

import ipaddress
import os

DEFAULT_TARGET_ADDRESS = "127.0.0.1:50051"
DEFAULT_DRAFT_ADDRESS = "127.0.0.1:50052"
DEFAULT_CONTROLLER_ADDRESS = "127.0.0.1:50053"
DEFAULT_METRICS = {
    "target": "127.0.0.1:9451",
    "draft": "127.0.0.1:9452",
    "controller": "127.0.0.1:9453",
}
# The target's OpenAI-compatible HTTP API (`specpair serve target --http-address`).
DEFAULT_HTTP_ADDRESS = "127.0.0.1:8000"


def env_address(service: str) -> str:
    """SPECPAIR_<SERVICE>_ADDRESS or the default address of `service`."""
    defaults = {
        "target": DEFAULT_TARGET_ADDRESS,
        "draft": DEFAULT_DRAFT_ADDRESS,
        "controller": DEFAULT_CONTROLLER_ADDRESS,
    }
    return os.environ.get(f"SPECPAIR_{service.upper()}_ADDRESS", defaults[service])


def env_http_address() -> str:
    """SPECPAIR_HTTP_ADDRESS or the default address of the target's HTTP API."""
    return os.environ.get("SPECPAIR_HTTP_ADDRESS", DEFAULT_HTTP_ADDRESS)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address's host part) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or "" / 0.0.0.0-like wildcards
        return False


def check_grpc_address(address: str) -> str:
    """A gRPC address: HOST:PORT, or unix:PATH for a Unix domain socket (services on one host)."""
    if address.startswith("unix:"):
        if not address.removeprefix("unix:").strip("/"):
            raise ValueError(f"address {address!r}: unix: needs a socket path")
        return address
    try:
        split_address(address)
    except ValueError:
        raise ValueError(f"address {address!r} must be HOST:PORT or unix:PATH") from None
    return address


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated list of addresses, blanks dropped."""
    return tuple(part.strip() for part in value.split(",") if part.strip())
