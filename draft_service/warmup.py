"""The draft service's warm-up, before SERVING (`specpair/runtime/warmup.py` says why).

Rounds on the wire path a target's rounds take (`DraftRounds.run` on an encoded RoundRequest,
then `prepare` as the servicer calls it), per built tier, tier 0 included:

    round 1  a new request's prompt (PROMPT_TOKENS: past the extend graphs, so it runs the
             eager prefill a real prompt runs) → extend, draft at the tier
    round 2  s + 1 appended tokens (a round's accepted drafts + bonus) → the tier's extend
             graph and its draft steps
    round 3  its release (its slot)
    once greedy, once sampled (the greedy and the sampled step graphs), each request alone so
    that one slot suffices; then a check that every slot and page came back.
"""

from __future__ import annotations

import time

import torch

from draft_service.rounds import DraftRounds
from specpair.logging import get_logger
from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import encode_request, read_round
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.warmup import GREEDY, PROMPT_TOKENS, SAMPLED, Held, dummy_tokens, warming

log = get_logger(__name__)
STREAM = "warm-up#0"  # a stream of its own: its keys are no target's


def warm_up(rounds: DraftRounds) -> float:
    """Every built tier's rounds, greedy and sampled; returns the seconds it took. Raises
    RuntimeError if a round is refused or the warm-up leaves anything held."""
    t0 = time.perf_counter()
    held = Held(rounds.drafter.cache)
    warm = WarmRounds(rounds)
    for tier in sorted(rounds.states):
        what = "extend/prefill (tier 0)" if tier.steps == 0 else f"draft at tier {tier}"
        with warming(log, what):
            for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
                warm.request(tier, f"{tier}-{name}", sampling)
    if rounds.active_requests:
        raise RuntimeError(f"draft warm-up leaked: {rounds.active_requests} requests still held")
    held.check("draft")
    return time.perf_counter() - t0


class WarmRounds:
    """The warm-up's rounds on one stream, numbered as a target numbers its own."""

    def __init__(self, rounds: DraftRounds) -> None:
        self.rounds, self.round_id = rounds, 0
        drafter = rounds.drafter
        self.vocab = rounds.vocab_size
        # an EAGLE head extends from the target's features: zeros of the width it reads
        self.feature_width = drafter.feature_width if drafter.needs_features else 0

    def prompt_len(self, steps: int) -> int:
        """PROMPT_TOKENS, or fewer where the prompt and its round must fit a short context."""
        return max(2, min(PROMPT_TOKENS, self.rounds.config.max_len - 2 * (steps + 1)))

    def request(self, tier: TreeShape, request_id: str, sampling: SamplingParams) -> None:
        """A new request's two rounds at `tier` (its prompt, then a round's appended tokens),
        then its release."""
        prompt = dummy_tokens(self.prompt_len(tier.steps), self.vocab)
        # the first round's features are one fewer than its tokens (the target's prefill rows)
        self._round(tier, DraftInput(request_id, prompt, sampling, self._features(len(prompt) - 1)))
        appended = dummy_tokens(tier.steps + 1, self.vocab, offset=len(prompt))
        self._round(tier, DraftInput(request_id, appended, sampling, self._features(len(appended))))
        # released as a finished request is: its slot goes back
        self.send(RoundRequest(self.round_id, 0, released_request_ids=(request_id,)))

    def _features(self, rows: int) -> torch.Tensor | None:
        return torch.zeros(rows, self.feature_width) if self.feature_width else None

    def _round(self, tier: TreeShape, item: DraftInput) -> None:
        shape = None if tier.is_chain else tier
        request = RoundRequest(self.round_id, tier.steps, (item,), shape=shape)
        answer = self.send(request)
        if item.request_id not in {tree.request_id for tree in answer.trees}:
            why = dict(answer.refused).get(item.request_id, "no tree came back")
            raise RuntimeError(f"draft warm-up: round {request.round_id} at tier {tier}: {why}")

    def send(self, request: RoundRequest) -> draft_pb2.RoundResponse:
        """One round as the servicer serves it: run, then the plan ahead."""
        rounds = self.rounds
        answer = rounds.run(STREAM, read_round(encode_request(request)))
        self.round_id += 1
        if answer.refused:
            raise RuntimeError(
                f"draft warm-up: round {request.round_id} at tier {request.tier} refused: "
                f"{answer.message.error}"
            )
        if rounds.plans_ahead:
            rounds.prepare(STREAM, request)
        return answer.message
