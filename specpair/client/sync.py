"""The blocking SDK: the asyncio clients run on a private event loop in a daemon thread.

Each blocking call hands one coroutine to that loop and waits for it; a stream hands over one
`anext` per delta. The loop is the client's own, so a blocking client works inside a program
that runs its own loop elsewhere, and from several threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, Unpack

from specpair.client.aio import (
    AsyncControllerClient,
    AsyncSpecpairClient,
    Connection,
    ConnectionOptions,
)
from specpair.client.requests import GenerateParams, Messages, Prompt
from specpair.client.results import ControllerState, GenerateDelta, GenerateResult
from specpair.target_state import TargetState

T = TypeVar("T")
C = TypeVar("C", bound=Connection)


# Signals a person sends a blocking program. Only the main thread may take them: one that lands
# on another thread runs Python's handler later, on the main thread's next bytecode, and a main
# thread blocked in `input()` has none (`specpair chat` hung on Ctrl-C).
_MAIN_THREAD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        # A thread starts with its creator's mask, and gRPC's threads start from this one (the
        # channel opens on the loop), so blocking them here keeps them off every thread of ours.
        with _signals_blocked():
            self.thread.start()
        # A client dropped without close() still stops its thread.
        self._finalizer = weakref.finalize(self, _stop, self.loop, self.thread)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C while waiting: the call is cancelled on the loop too
            raise

    def iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(anext(stream))  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            # Runs the stream's own `finally` (cancelling the call) when the consumer stops
            # early; a stream whose `anext` was just cancelled is already closing itself.
            with contextlib.suppress(RuntimeError):
                self.run(stream.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        self._finalizer()


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    if not hasattr(signal, "pthread_sigmask"):  # Windows delivers Ctrl-C to the main thread
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


class _Blocking(Generic[C]):
    _async_class: type[C]

    def __init__(self, address: str | None = None, **options: Unpack[ConnectionOptions]) -> None:
        self._loop = _LoopThread()
        self._async: C = self._async_class(address, **options)
        self.address: str = self._async.address

    @property
    def timeout(self) -> float | None:
        return self._async.timeout

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # a loop already stopped (interpreter exit)
            self._loop.run(self._async.close())
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SpecpairClient(_Blocking[AsyncSpecpairClient]):
    """Blocking client of a target service; `AsyncSpecpairClient` documents each method."""

    _async_class = AsyncSpecpairClient

    def generate(self, prompt: Prompt, **params: Unpack[GenerateParams]) -> GenerateResult:
        return self._loop.run(self._async.generate(prompt, **params))

    def stream(self, prompt: Prompt, **params: Unpack[GenerateParams]) -> Iterator[GenerateDelta]:
        return self._loop.iterate(self._async.stream(prompt, **params))

    def chat(self, messages: Messages, **params: Unpack[GenerateParams]) -> GenerateResult:
        return self._loop.run(self._async.chat(messages, **params))

    def stream_chat(
        self, messages: Messages, **params: Unpack[GenerateParams]
    ) -> Iterator[GenerateDelta]:
        deltas = self._async.stream_chat(messages, **params)
        return self._loop.iterate(deltas)

    def server_info(self) -> dict[str, Any]:
        return self._loop.run(self._async.server_info())


class ControllerClient(_Blocking[AsyncControllerClient]):
    """Blocking client of the controller's ops API; `AsyncControllerClient` documents it."""

    _async_class = AsyncControllerClient

    def state(self) -> ControllerState:
        return self._loop.run(self._async.state())

    def update_policy(self, **changes: Any) -> dict[str, Any]:
        return self._loop.run(self._async.update_policy(**changes))

    def pin(self, tier: int | str) -> tuple[TargetState, ...]:
        return self._loop.run(self._async.pin(tier))

    def unpin(self) -> tuple[TargetState, ...]:
        return self._loop.run(self._async.unpin())
