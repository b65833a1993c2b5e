"""The one request path of the target's front doors (gRPC, HTTP): validate, submit, stream.

Both doors build a `ClientRequest` (`request.py`) and read `GenerateResponse`s from
`Frontend.generate`; each maps the typed errors below onto its own status codes. Validation,
admission, detokenization, stop strings, cancellation and the per-request metrics live here
only.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncGenerator
from typing import Any

import structlog

from specpair.config import TargetConfig
from specpair.logging import get_logger
from specpair.proto.v1 import target_pb2
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.target.worker import TargetSequence
from target_service.batching.scheduler import Scheduler
from target_service.batching.served import RoundEvent, ServedRequest
from target_service.request_path.detokenize import TextStream
from target_service.request_path.request import ClientRequest
from target_service.request_path.validation import validate_generate

log = get_logger(__name__)
FINISH = {
    "length": target_pb2.FINISH_REASON_LENGTH,
    "stop": target_pb2.FINISH_REASON_STOP,
}


class NotReadyError(RuntimeError):
    """The model and its tier states are still being built."""


class RoundFailedError(RuntimeError):
    """The round that served the request failed (a bug; the scheduler logged it)."""


class TargetDownError(NotReadyError, RoundFailedError):
    """The target is going down (a tensor-parallel rank exited or hung); the message says why.
    Before a response it is refused as a loading target is (UNAVAILABLE, 503); after one it
    fails the request as a failed round does."""


class DeadlineExceededError(RuntimeError):
    """The client's deadline passed on arrival or while the request queued (never prefilled)."""


class Frontend:
    def __init__(self, config: TargetConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler: Scheduler | None = None  # set once the model and states are built
        self.tokenizer: Any = None
        self.eos: frozenset[int] = frozenset()  # end every generation (`eos_ids`)
        self.bos: int | None = None  # starts every text prompt (`prompt_bos`)
        self.failure: str | None = None  # why the target is going down (`fail`)
        self._ids = itertools.count()
        self._flying: set[ServedRequest] = set()  # submitted, their clients still reading

    def ready(self) -> Scheduler:
        if self.failure is not None:
            raise TargetDownError(self.failure)
        if self.scheduler is None:
            raise NotReadyError("target model is still loading")
        return self.scheduler

    def fail(self, message: str) -> None:
        """The target is going down: every request in flight is answered with `message` now
        (its round may never return: a hung rank holds it), and new ones are refused."""
        self.failure = message
        for served in self._flying:
            served.events.put_nowait(RoundEvent([], -1, 0, "error"))

    async def generate(
        self, request: ClientRequest, *, time_remaining: float | None = None
    ) -> AsyncGenerator[target_pb2.GenerateResponse, None]:
        """One response per round with new tokens; the last carries finish_reason, usage and
        speculation stats.

        Raises (before the first response) NotReadyError, InvalidRequestError (its message
        names the field) or QueueFullError; RoundFailedError or DeadlineExceededError (the
        client's `time_remaining` seconds ran out while the request queued) later;
        TargetDownError (both a NotReadyError and a RoundFailedError) at any point. Closing
        the generator early (a client that went away) cancels the request: it leaves at the
        next round boundary and its KV is freed on both services. Callers close it deterministically
        (`contextlib.aclosing`), not at garbage collection.
        """
        arrival = time.perf_counter()
        scheduler = self.ready()
        check = functools.partial(
            validate_generate,
            request,
            tokenizer=self.tokenizer,
            vocab_size=scheduler.worker.model.args.vocab_size,
            max_len=self.config.max_len,
            bos=self.bos,
        )
        # Tokenizing takes milliseconds per 10 KB of text: on the loop it would stall every
        # stream, so text (a prompt, or chat messages to template) goes to a worker thread.
        textual = bool(request.prompt) or len(request.messages) > 0
        valid = await asyncio.to_thread(check) if textual else check()
        request_id = request.request_id or f"req-{next(self._ids)}"
        # Keyed by our own id on the draft link: clients may reuse a request_id (two at once
        # would share draft state), and theirs may be long, ours rides in every round.
        seq = TargetSequence(
            f"r{next(self._ids)}",
            valid.prompt_ids,
            valid.sampling,
            valid.max_tokens,
            valid.stop_token_ids | self.eos,
        )
        if time_remaining is not None and time_remaining <= 0:
            raise DeadlineExceededError("deadline passed on arrival")
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        served = ServedRequest(seq, deadline=deadline)
        scheduler.submit(served)
        self._flying.add(served)
        self.metrics.prompt_tokens.inc(len(valid.prompt_ids))
        structlog.contextvars.bind_contextvars(request_id=request_id)
        log.info(
            "request admitted", prompt_tokens=len(valid.prompt_ids), max_tokens=valid.max_tokens
        )
        text = TextStream(self.tokenizer, valid.stop)
        start = last = time.perf_counter()
        finished = False
        completion = 0
        try:
            while not finished:
                event = await served.events.get()
                if event.finish_reason == "error":
                    finished = True
                    if self.failure is not None:
                        raise TargetDownError(self.failure)
                    raise RoundFailedError("the round failed; see logs")
                if event.finish_reason == "expired":
                    finished = True
                    raise DeadlineExceededError("deadline passed before admission")
                tokens, delta, stop_hit = text.push(
                    event.token_ids, final=event.finish_reason is not None
                )
                if tokens:
                    last = self._observe_latency(len(tokens), completion, start, last)
                    self.metrics.generation_tokens.inc(len(tokens))
                completion += len(tokens)
                reason = "stop" if stop_hit else event.finish_reason
                finished = reason is not None
                response = target_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=tokens,
                    text=delta,
                    accept_length=event.accept_length,
                    speculative_num_steps=event.tier,
                )
                if finished:
                    if stop_hit and event.finish_reason is None:
                        scheduler.cancel(served, "stop")
                    _finalize(response, served, reason or "length", completion)
                    self.metrics.request_latency.observe(time.perf_counter() - arrival)
                yield response
        finally:
            self._flying.discard(served)
            if not finished:  # the client went away (cancelled, deadline, disconnected)
                scheduler.cancel(served)
                log.info("request cancelled")
            structlog.contextvars.unbind_contextvars("request_id")

    def _observe_latency(self, n: int, streamed: int, start: float, last: float) -> float:
        """TTFT for the first token; per later token its share of the wait for its message
        (4 tokens 20 ms after the previous message: four 5 ms observations). Returns now."""
        now = time.perf_counter()
        if streamed == 0:
            self.metrics.ttft.observe(now - start)
            n, wait = n - 1, 0.0  # the first message's other tokens came with the first
        else:
            wait = now - last
        for _ in range(n):
            self.metrics.itl.observe(wait / n)
        return now


def _finalize(
    response: target_pb2.GenerateResponse, served: ServedRequest, reason: str, n: int
) -> None:
    accepts = served.accept_lengths
    response.finish_reason = FINISH.get(reason, target_pb2.FINISH_REASON_STOP)
    response.usage.CopyFrom(
        target_pb2.Usage(prompt_tokens=len(served.seq.prompt), completion_tokens=n)
    )
    response.speculation.CopyFrom(
        target_pb2.SpeculationStats(
            accept_lengths=accepts,
            rounds=len(accepts) + served.plain_rounds,
            plain_rounds=served.plain_rounds,
            avg_accept_length=sum(accepts) / len(accepts) if accepts else 0.0,
        )
    )
