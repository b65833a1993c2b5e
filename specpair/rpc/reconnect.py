"""A link to one peer that keeps itself connected: the target's to its draft, the controller's
to each target.

    connect ──ok──► hold (until the session ends) ──► drop ──► wait ──► connect …
       └──fails──────────────────────────────────────► drop ──► wait (doubling, capped) ──┘

A session that held at least `backoff_max_s` and ended is retried at once, and the wait starts
again at `backoff_min_s`; it doubles up to `backoff_max_s` while attempts keep failing, and a
session that ends as soon as it began (a peer that accepts the connection, then refuses the
stream: every watcher place taken) is a failure like any other, so a refusal is not retried in
a tight loop. A subclass may ask for another wait for a failure it understands (a draft that
refused this target is looked at again only every max seconds; a late one when its bench
ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from specpair.config import TLSConfig
from specpair.rpc.channels import open_channel

CLOSE_TIMEOUT_S = 2.0  # shutting down never waits on a peer longer than this


class ReconnectingLink:
    """Subclasses give `_connect` (open a session on `self._channel`, raise on failure),
    `_hold` (return when the session ended) and `_failed` (log; how long to wait)."""

    def __init__(
        self,
        address: str,
        *,
        name: str,
        tls: TLSConfig | None = None,
        backoff_min_s: float = 0.2,
        backoff_max_s: float = 5.0,
        authority: str | None = None,
    ) -> None:
        if not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError("need 0 < backoff_min_s <= backoff_max_s")
        self.address = address
        self.tls = tls
        self.authority = authority  # the peer's name when `address` is one of its IPs
        self.backoff = (backoff_min_s, backoff_max_s)
        self._name = name
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_connected(), name=self._name)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop()

    def _open(self) -> grpc.aio.Channel:
        self._channel = open_channel(self.address, self.tls, authority=self.authority)
        return self._channel

    async def _keep_connected(self) -> None:
        delay = self.backoff[0]
        while True:
            connected_at: float | None = None
            failure: Exception | None = None
            try:
                await self._connect()
                connected_at = time.monotonic()
                await self._hold()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: back off and try again
                failure = exc
            held = connected_at is not None and time.monotonic() - connected_at >= self.backoff[1]
            if held:
                delay = self.backoff[0]
            if failure is None and held:
                wait = 0.0  # the peer restarted, or a round failed: try again at once
            else:
                wait = delay if failure is None else self._failed(failure, delay)
                delay = min(delay * 2, self.backoff[1])
            await self._drop()
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # A close() came while the drop awaited a call that swallowed its cancel (grpc's
                # close, or wait_for on Python 3.11): close() waits for this loop to end.
                raise asyncio.CancelledError
            await asyncio.sleep(wait)

    async def _connect(self) -> None:
        raise NotImplementedError

    async def _hold(self) -> None:
        raise NotImplementedError

    def _failed(self, exc: Exception, retry_s: float) -> float:
        raise NotImplementedError

    def _detach(self) -> None:
        """Forgets the session's calls (the channel is closed right after)."""

    async def _drop(self) -> None:
        # Detach first: a failed call, the reconnect loop and close() may all drop at once,
        # and each channel must be closed exactly once.
        self._detach()
        channel, self._channel = self._channel, None
        if channel is not None:
            # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose inner call ends as
            # the link is closed swallows the cancel, and the reconnect loop ran on with close()
            # waiting for it (the controller test hung 1 run in 6 of its file under load).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await channel.close(grace=None)
