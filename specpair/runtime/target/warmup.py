"""The target's warm-up, before SERVING (`specpair/runtime/warmup.py` says why).

The worker's calls a request's first rounds make, on dummy sequences released after:

    prefill   a short prompt (on a GPU, in a prefill graph), greedy and sampled, each then
              verified without drafts (plain decoding: the eager verify); where prefill graphs
              exist and the context allows, a prompt past the largest (eager: flashinfer's
              prefill, the module a long prompt would compile on first use)
    verify    per built tier, a new request's tree of its shape planned ahead (`prepare`, as
              the scheduler does while the draft drafts) and verified, greedy and sampled (the
              accept paths: argmax, the sampled accept)
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from specpair.logging import get_logger
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE
from specpair.runtime.warmup import (
    GREEDY,
    PROMPT_TOKENS,
    SAMPLED,
    Held,
    dummy_tokens,
    dummy_tree,
    warming,
)

log = get_logger(__name__)


def warm_up(worker: TargetWorker, states: Mapping[TreeShape, SpecRuntimeState]) -> float:
    """Prefill and every tier's verify, greedy and sampled; returns the seconds it took.
    Raises RuntimeError if the warm-up leaves a slot or page held."""
    t0 = time.perf_counter()
    held = Held(worker.cache)
    vocab = worker.model.args.vocab_size
    max_len = worker.cache.max_len
    deepest = max((tier.num_draft_tokens for tier in states), default=0)
    # room for the prompt, then one verify of the largest tree (its rows and the bonus)
    short = max(1, min(PROMPT_TOKENS, max_len - deepest - 2))

    def sequence(name: str, sampling: SamplingParams, n: int = short) -> TargetSequence:
        return TargetSequence(f"warm-up/{name}", list(dummy_tokens(n, vocab)), sampling, 1 << 20)

    # One sequence at a time, as every later round: a target may hold a single slot.
    with warming(log, "prefill and verify without drafts"):
        for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
            seq = sequence(name, sampling)
            worker.prefill([seq])
            worker.verify([seq], [EMPTY_TREE])  # plain decoding: the eager verify
            worker.release(seq)
        graphs = worker.prefill_graphs
        longest = graphs.longest if graphs is not None else 0
        if longest and longest + 1 <= max_len - deepest - 2:
            past = sequence("long", GREEDY, longest + 1)
            worker.prefill([past])
            worker.release(past)
    for tier in sorted(states):
        state = states[tier]
        if tier.steps == 0:
            continue  # tier 0 verifies as plain decoding does, warmed above
        with warming(log, f"verify at tier {tier}"):
            for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
                seq = sequence(f"{tier}-{name}", sampling)
                worker.prefill([seq])
                # a joiner riding in the verify where the worker rides them (`verify`)
                rider = sequence(f"{tier}-{name}-rider", sampling)
                rides = worker.cache.free_slots and worker.rides(state, 1, [len(rider.prompt)])
                riders = [rider] if rides else []
                for r in riders:
                    r.slot = worker.cache.alloc()
                worker.prepare([seq], state, None, riders)
                worker.verify([seq], [dummy_tree(tier, vocab, not sampling.greedy)], state, riders)
                for r in [seq, *riders]:
                    worker.release(r)
    held.check("target")
    worker.accept_paths.clear()  # the counts describe served verifies, not these
    return time.perf_counter() - t0
