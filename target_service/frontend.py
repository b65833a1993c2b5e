"""The one request path of the target's front doors (gRPC, HTTP): validate, submit, stream.

Both doors build a `GenerateRequest` and read `GenerateResponse`s from `Frontend.generate`;
each maps the typed errors below onto its own status codes. Validation, admission,
detokenization, stop strings, cancellation and the per-request metrics live here only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator
from typing import Any

import structlog

from specpair.config import TargetConfig
from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.proto.v1 import target_pb2
from specpair.runtime.target import TargetSequence
from target_service.detokenize import TextStream
from target_service.scheduler import Scheduler, ServedRequest
from target_service.validation import validate_generate

log = get_logger(__name__)
FINISH = {
    "length": target_pb2.FINISH_REASON_LENGTH,
    "stop": target_pb2.FINISH_REASON_STOP,
}


class NotReadyError(RuntimeError):
    """The model and its tier states are still being built."""


class RoundFailedError(RuntimeError):
    """The round that served the request failed (a bug; the scheduler logged it)."""


class Frontend:
    def __init__(self, config: TargetConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler: Scheduler | None = None  # set once the model and states are built
        self.tokenizer: Any = None
        self.eos: frozenset[int] = frozenset()
        self._ids = itertools.count()

    def ready(self) -> Scheduler:
        if self.scheduler is None:
            raise NotReadyError("target model is still loading")
        return self.scheduler

    async def generate(
        self, request: target_pb2.GenerateRequest
    ) -> AsyncGenerator[target_pb2.GenerateResponse, None]:
        """One response per round with new tokens; the last carries finish_reason, usage and
        speculation stats.

        Raises (before the first response) NotReadyError, InvalidRequestError (its message
        names the field) or QueueFullError; RoundFailedError later. Closing the generator
        early (a client that went away) cancels the request: it leaves at the next round
        boundary and its KV is freed on both services. Callers close it deterministically
        (`contextlib.aclosing`), not at garbage collection.
        """
        scheduler = self.ready()
        valid = validate_generate(
            request,
            tokenizer=self.tokenizer,
            vocab_size=scheduler.worker.model.args.vocab_size,
            max_len=self.config.max_len,
        )
        request_id = request.request_id or f"req-{next(self._ids)}"
        seq = TargetSequence(
            request_id, valid.prompt_ids, valid.sampling, valid.max_tokens,
            valid.stop_token_ids | self.eos,
        )  # fmt: skip
        served = ServedRequest(seq)
        scheduler.submit(served)
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
                    raise RoundFailedError("the round failed; see logs")
                now = time.perf_counter()
                hist = self.metrics.itl if completion else self.metrics.ttft
                hist.observe(now - last if completion else now - start)
                last = now
                tokens, delta, stop_hit = text.push(event.token_ids)
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
                yield response
        finally:
            if not finished:  # the client went away (cancelled, deadline, disconnected)
                scheduler.cancel(served)
                log.info("request cancelled")
            structlog.contextvars.unbind_contextvars("request_id")


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
