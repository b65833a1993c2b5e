"""The draft replicas behind a `--draft` entry: a host name resolving to several addresses
of one family (a Kubernetes headless Service) is a replica per address."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from specpair.config import split_address
from specpair.logging import get_logger

log = get_logger(__name__)


def is_name(entry: str) -> bool:
    """Whether `entry` is HOST:PORT with a host name (not unix:, not an IP literal)."""
    if entry.startswith("unix:"):
        return False
    host = split_address(entry)[0]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


async def resolve(entry: str) -> list[str]:
    """The replicas behind `entry`: itself, unless it is a name resolving to several addresses
    of one family (IPv4 first: `localhost` is one replica, not its IPv4 and IPv6 twins); []
    when the lookup fails."""
    if not is_name(entry):
        return [entry]
    host, port = split_address(entry)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("draft address lookup failed", address=entry, error=str(exc))
        return []
    for family, form in ((socket.AF_INET, "{}:{}"), (socket.AF_INET6, "[{}]:{}")):
        ips = sorted({str(info[4][0]) for info in infos if info[0] == family})
        if ips:
            return [entry] if len(ips) == 1 else [form.format(ip, port) for ip in ips]
    return [entry]
