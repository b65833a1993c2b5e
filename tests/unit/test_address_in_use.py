"""specpair.cli.group.address_in_use: a listener counts, a free port and a self-connect do not."""

from __future__ import annotations

import socket

import pytest

from specpair.cli import group
from specpair.cli.group import address_in_use


def test_a_listening_port_is_in_use_and_a_closed_one_is_not() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert address_in_use(address)
    assert not address_in_use(address)


class SelfConnected(socket.socket):
    """A probe whose connect landed on its own port (TCP simultaneous open on loopback)."""

    def connect(self, address: object) -> None:
        self._peer = address

    def getsockname(self) -> object:
        return self._peer

    def getpeername(self) -> object:
        return self._peer


def test_a_probe_connected_to_itself_is_not_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group.socket, "socket", SelfConnected)
    assert not address_in_use("127.0.0.1:40000")
