"""Services as child processes (`specpair serve …`): started in order, each healthy before the
next, stopped together. `specpair up`, the benchmarks and the end-to-end tests all use it."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from specpair.config import split_address
from specpair.rpc.healthcheck import check

SERVE = (sys.executable, "-m", "specpair.cli", "serve")
STOP_GRACE_S = 15.0  # SIGTERM, then this long for a graceful stop, then SIGKILL


@dataclass(frozen=True)
class Service:
    name: str  # unique in its group; also names its log file
    address: str  # where its health is checked
    args: tuple[str, ...]  # after `specpair serve`: ("draft", "--model", …)
    env: Mapping[str, str] | None = None  # None: this process's environment
    cpus: frozenset[int] | None = None  # CPUs it may run on (None: any)


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
        # A loopback connect to a free port in the ephemeral range can pick that very port as
        # its source and connect to itself (TCP simultaneous open): nobody serves there.
        return address.startswith("unix:") or probe.getsockname() != probe.getpeername()


class ServiceGroup:
    """Child processes by name. Used as a context manager it starts `services` in order and
    stops every process it started on the way out, however it leaves.

    With `log_dir` each process writes to `<log_dir>/<name>.log`, else to our terminal.
    """

    def __init__(
        self,
        services: Iterable[Service] = (),
        *,
        log_dir: Path | None = None,
        health_timeout_s: float = 300.0,
    ) -> None:
        self.services = list(services)
        self.log_dir = log_dir
        self.health_timeout_s = health_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._addresses: dict[str, str] = {}

    def __enter__(self) -> Self:
        try:
            for service in self.services:
                self.start(service)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, service: Service) -> subprocess.Popen[bytes]:
        """Launches `service` and waits until it reports SERVING."""
        proc = self.launch(service)
        self.wait_healthy(service.name)
        return proc

    def launch(self, service: Service) -> subprocess.Popen[bytes]:
        """Launches `service` without waiting; refuses an address another process serves
        (ours would fail to bind, but the health check could reach the other one first)."""
        if address_in_use(service.address):
            raise RuntimeError(
                f"{service.name}: {service.address} is already in use by another process "
                f"(stop it, or set SPECPAIR_{service.name.upper()}_ADDRESS)"
            )
        out = None
        if self.log_dir is not None:
            out = open(self.log_dir / f"{service.name}.log", "ab")  # noqa: SIM115 - the child's
        cpus = service.cpus
        env = {**(service.env or os.environ), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [*SERVE, *service.args],
            stdout=out,
            stderr=out,
            env=env,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        self.procs[service.name] = proc
        self._addresses[service.name] = service.address
        return proc

    def wait_healthy(self, name: str) -> None:
        proc, address = self.procs[name], self._addresses[name]
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} during start-up{self._tail(name)}"
                )
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                if check(address, timeout=1.0):
                    return
            time.sleep(0.2)
        raise RuntimeError(
            f"{name} at {address} not healthy after {self.health_timeout_s:.0f} s{self._tail(name)}"
        )

    def exited(self) -> str | None:
        """The name of a process that has exited, if any."""
        return next((name for name, p in self.procs.items() if p.poll() is not None), None)

    def stop(self) -> None:
        """SIGTERM to every running process, SIGKILL to any still running after the grace."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _tail(self, name: str) -> str:
        if self.log_dir is None:
            return ""
        log = self.log_dir / f"{name}.log"
        return f"; its log ends:\n{log.read_text()[-3000:]}" if log.is_file() else ""
