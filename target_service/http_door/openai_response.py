"""GenerateResponses as OpenAI's completion objects and server-sent chunks (pure, no I/O)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specpair.proto.v1 import target_pb2
from target_service.http_door.openai_request import ApiRequest

_FINISH = {target_pb2.FINISH_REASON_LENGTH: "length", target_pb2.FINISH_REASON_STOP: "stop"}


@dataclass(slots=True)
class ResponseWriter:
    """Turns one request's GenerateResponses into OpenAI's response objects and chunks."""

    api: ApiRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    tier: int = 0

    def _base(self, response: target_pb2.GenerateResponse, *, chunk: bool) -> dict[str, Any]:
        if not self.id:
            self.id = ("chatcmpl-" if self.api.chat else "cmpl-") + response.request_id
        if self.api.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunks(self, response: target_pb2.GenerateResponse, first: bool) -> list[dict[str, Any]]:
        """The SSE events of one response (none for a round that added no text)."""
        self.tier = response.speculative_num_steps or self.tier
        finish = _FINISH.get(response.finish_reason)
        if not response.text and finish is None and not first:
            return []
        choice: dict[str, Any] = {"index": 0}
        if self.api.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if response.text or first:
                delta["content"] = response.text
            choice["delta"] = delta
        else:
            choice["text"] = response.text
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        chunk = self._base(response, chunk=True) | {"choices": [choice]}
        if self.api.include_usage:
            chunk["usage"] = None
        if finish is None:
            return [chunk]
        chunk["meta_info"] = self.meta_info(response)
        if not self.api.include_usage:
            return [chunk]
        usage_chunk = self._base(response, chunk=True) | {
            "choices": [],
            "usage": usage(response),
        }
        return [chunk, usage_chunk]

    def completion(self, responses: list[target_pb2.GenerateResponse]) -> dict[str, Any]:
        """The whole (non-streamed) response; the last GenerateResponse carries the totals."""
        last = responses[-1]
        self.tier = last.speculative_num_steps
        text = "".join(r.text for r in responses)
        choice: dict[str, Any] = {"index": 0}
        if self.api.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = _FINISH.get(last.finish_reason, "stop")
        return self._base(last, chunk=False) | {
            "choices": [choice],
            "usage": usage(last),
            "meta_info": self.meta_info(last),
        }

    def meta_info(self, last: target_pb2.GenerateResponse) -> dict[str, Any]:
        """Speculation statistics, where SGLang's responses carry theirs."""
        spec = last.speculation
        return {
            "request_id": last.request_id,
            "accept_lengths": list(spec.accept_lengths),
            "avg_accept_length": spec.avg_accept_length,
            "rounds": spec.rounds,
            "plain_rounds": spec.plain_rounds,
            "speculative_num_steps": self.tier,
        }


def usage(last: target_pb2.GenerateResponse) -> dict[str, int]:
    prompt, completion = last.usage.prompt_tokens, last.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
