"""structlog set-up shared by every process (JSON lines, or console rendering on a TTY), and
what keeps a peer from filling a log or an error: `bounded` text, `Repeats` left out."""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import structlog


def configure_logging(service: str, *, level: str = "INFO", json: bool | None = None) -> None:
    """JSON to stderr unless stderr is a TTY (then coloured console); `service` on every line."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


MAX_DETAILS_CHARS = 512  # an error names the field; echoing a 100k-item list overflows metadata


def bounded(details: str) -> str:
    """Text a peer or a client chose (an error's details, a draft's error string) cut to
    MAX_DETAILS_CHARS, so a huge value is never echoed or logged whole."""
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return details[: MAX_DETAILS_CHARS - 1] + "…"


class Repeats:
    """Which occurrences of a repeated event to log: the first, then at most one every `every_s`
    seconds, each saying how many were left out since — a peer that fails every round (a draft
    answering an error, a target retrying a refused stream) cannot fill the log.

        repeats = Repeats(10.0)
        if (left_out := repeats.due("draft error")) is not None:
            log.warning("draft refused the round", error=..., left_out=left_out)
    """

    MAX_KEYS = 256  # the events remembered (the least recent forgotten first)

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # → (logged, left out)

    def due(self, key: Hashable) -> int | None:
        """How many occurrences of `key` were left out since the last one logged, when this one
        is to be logged; None when it is to be left out."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.MAX_KEYS:
            self._last.popitem(last=False)
        return 0 if last is None else last[1]
