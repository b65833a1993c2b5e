"""The reconnect core shared by the target's DraftLink and the controller's TargetLink."""

from __future__ import annotations

import asyncio

import pytest

from specpair.rpc.reconnect import ReconnectingLink

REAL_SLEEP = asyncio.sleep  # the tests below record the link's waits through asyncio.sleep


class ScriptedLink(ReconnectingLink):
    """Connects per a script of outcomes; records each wait the core asks for."""

    def __init__(self, outcomes: list[str], refuse_wait: float) -> None:
        super().__init__("127.0.0.1:1", name="scripted", backoff_min_s=0.01, backoff_max_s=0.04)
        self.outcomes = outcomes
        self.refuse_wait = refuse_wait
        self.events: list[str] = []
        self.done = asyncio.Event()

    async def _connect(self) -> None:
        if not self.outcomes:
            self.done.set()
            await asyncio.Event().wait()  # stays "connecting" until cancelled
        outcome = self.outcomes.pop(0)
        self.events.append(outcome)
        if outcome not in ("ok", "held"):
            raise ConnectionError(outcome)

    async def _hold(self) -> None:
        if self.events[-1] == "held":  # a session that lasts past the longest backoff
            await REAL_SLEEP(self.backoff[1] + 0.01)
        self.events.append("session ended")

    def _failed(self, exc: Exception, retry_s: float) -> float:
        wait = self.refuse_wait if str(exc) == "refused" else retry_s
        self.events.append(f"wait {wait:g}")
        return wait

    def _detach(self) -> None:
        self.events.append("dropped")


async def test_backoff_doubles_while_failing_and_resets_on_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    script = ["down", "down", "down", "down", "held", "down", "ok", "down", "refused"]
    link = ScriptedLink(script, 9.0)
    link.start()
    await asyncio.wait_for(link.done.wait(), 5)
    await link.close()
    # 0.01 doubling to the 0.04 cap; a session that held past the cap is retried at once and
    # resets it; one that ends as soon as it began (a peer refusing the stream it accepted) is a
    # failure like any other, so it is not retried in a tight loop; a failure the link
    # understands waits what the link says.
    assert waits == [0.01, 0.02, 0.04, 0.04, 0.0, 0.01, 0.02, 0.04, 9.0]
    assert link.events[:9] == [
        "down",
        "wait 0.01",
        "dropped",
        "down",
        "wait 0.02",
        "dropped",
        "down",
        "wait 0.04",
        "dropped",
    ]
    assert link.events[-2:] == ["dropped", "dropped"]  # the last attempt's, then close()'s


def test_backoff_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="backoff_min_s"):
        ReconnectingLink("a:1", name="x", backoff_min_s=0)


async def test_close_ends_the_loop_when_a_drop_swallows_the_cancel() -> None:
    """A drop that awaits a call which swallows the cancel (grpc's channel close; wait_for on
    Python 3.11 when the call ends as the cancel comes) must not keep the loop reconnecting
    while close() waits for it: a controller test hung 300 s so."""

    class SwallowingLink(ScriptedLink):
        def __init__(self) -> None:
            super().__init__(["refused"] * 1000, refuse_wait=0.0)
            self.dropping = asyncio.Event()
            self.swallow = True

        async def _drop(self) -> None:
            self.dropping.set()
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if not self.swallow:
                    raise
                # swallowed, as the call under it did

    link = SwallowingLink()
    link.start()
    await link.dropping.wait()
    closing = asyncio.ensure_future(link.close())
    done, _ = await asyncio.wait({closing}, timeout=2.0)  # waits without cancelling it
    link.swallow = False  # a loop that ran on ends at the next cancel (the test's teardown)
    assert closing in done, "close() still waiting for the reconnect loop"
