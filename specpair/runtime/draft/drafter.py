"""The draft's stages: *extend* its KV cache with the appended tokens, then *draft* s steps.

Per request the draft keeps a KV slot whose committed length covers every token the target has
confirmed. Draft steps write tentatively past it and are never committed: the next round's
appended tokens (accepted drafts + bonus) overwrite them, which is the rollback.

`Drafter` is that round, shared by the two drafters of `drafters.py` (a standalone LM, an EAGLE
head), which differ in their extend rows and one forward (`extend.py`: `DraftForward`, the
extend). A tier of a tree shape drafts its trees eagerly (`tree_draft.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specpair.models.args import ModelArgs
from specpair.runtime.draft.extend import DraftForward
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.sampling import RowParams, derived_seed, draft_support, make_generator
from specpair.runtime.stages import DraftQ, DraftSampling, DraftStage, ExtendStage
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.tree import CandidateTree, chain


@dataclass
class DraftSlot:
    slot: int
    generator: torch.Generator


def _split(values: list[Tensor], counts: list[int]) -> list[list[int]]:
    """Device scalars read back in one copy, cut into rows of `counts`."""
    flat: list[int] = torch.stack(values).tolist() if values else []
    rows, n = [], 0
    for c in counts:
        rows.append(flat[n : n + c])
        n += c
    return rows


class Drafter(DraftForward):
    def __init__(self, cache: KVCache, device: torch.device, args: ModelArgs) -> None:
        self.cache = cache
        self.device = device
        self.args = args
        self.requests: dict[str, DraftSlot] = {}
        self.last_gpu_ms = 0.0  # GPU time of the last round's graph replays (0: none ran)
        self.profile = False  # when set, a greedy round synchronizes to time its stages apart
        self.last_times = (0.0, 0.0)  # (extend s, draft s) of the last round (host clock)

    def release(self, request_id: str) -> None:
        """Frees a finished or cancelled request's draft state (unknown ids are ignored)."""
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self.cache.free(entry.slot)

    def _slot(self, item: DraftInput) -> DraftSlot:
        entry = self.requests.get(item.request_id)
        if entry is None:
            # Seeded apart from the target's generator: q need only be *some* distribution.
            generator = make_generator(derived_seed(item.sampling.seed, 0x5EED))
            # Allocate last and record at once: nothing between can raise and strand the slot.
            entry = DraftSlot(self.cache.alloc(), generator)
            self.requests[item.request_id] = entry
        return entry

    @torch.inference_mode()
    def draft(self, inputs: Sequence[DraftInput], state: SpecRuntimeState) -> list[CandidateTree]:
        """The draft's round: *extend* every request, then *draft* a chain for each, of its own
        `steps` (0: `state.tier`, never more): greedy rounds through the tier's stages, sampling
        rounds eagerly (their warps and generators live on the host). At tier 0 it only
        extends: its cache follows the target, and every chain is empty."""
        depths = [item.steps or state.tier for item in inputs]
        if any(d > state.tier for d in depths):
            raise ValueError(f"a request asks for more than the round's {state.tier} steps")
        entries = [self._slot(item) for item in inputs]
        slots = [e.slot for e in entries]
        self.last_gpu_ms = 0.0
        t0 = time.perf_counter()
        if state.tier == 0:
            state.extend_stage().run(inputs, slots)
            self.last_times = (time.perf_counter() - t0, 0.0)
            return [chain(())] * len(inputs)
        extend, draft = self._stages(state)
        hidden = extend.run(inputs, slots)  # [B', 1, H] at each request's last row
        if self.profile and hidden.is_cuda:  # to time extend and draft apart
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        sampling = self._sampling(inputs, entries, state.tier)
        if not state.is_chain:  # a tree shape
            trees = draft.run_tree(hidden, slots, sampling, depths)
            self.last_gpu_ms = draft.read_gpu_ms()
            self.last_times = (t1 - t0, time.perf_counter() - t1)
            return trees
        qs: list[DraftQ | None] = [None] * len(inputs)
        draft.plan(slots)
        if sampling is not None:
            drafts, qs = draft.run_sampled(hidden, slots, sampling, depths)
        else:
            drafts = draft.run(hidden, slots, depths)
        self.last_gpu_ms = draft.read_gpu_ms()
        self.last_times = (t1 - t0, time.perf_counter() - t1)
        # A graph drafts every row to the tier: a shorter request's chain (and q) is cut to its
        # depth.
        return [
            chain(tokens[:d]) if q is None else chain(tokens[:d], q[1][:d], q[0][:d])
            for tokens, q, d in zip(drafts, qs, depths, strict=True)
        ]

    def _sampling(
        self, inputs: Sequence[DraftInput], entries: Sequence[DraftSlot], tier: int
    ) -> DraftSampling | None:
        """The round's sampling rows, None when every request is greedy: each sampling
        request draws `tier` uniforms from its own generator."""
        greedy = [item.sampling.greedy for item in inputs]
        if all(greedy):
            return None
        u = torch.full((len(inputs), tier), 0.5)
        for b, entry in enumerate(entries):
            if not greedy[b]:
                u[b] = torch.rand(tier, generator=entry.generator)
        params = RowParams.of([item.sampling for item in inputs])
        return DraftSampling(params, u, greedy)

    def draft_steps(
        self,
        hidden: Tensor,
        slots: list[int],
        tier: int,
        sampling: DraftSampling | None = None,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        """Up to `tier` steps after the committed lengths from hidden [B, 1, H], on the
        device: per request its tokens (`depths[b]` of them, default `tier`) and, where it
        samples, the q it drew them from (`draft_support`); the host reads them back once.
        A request leaves the batch at its depth: depths [1, 3] run step 1 for both rows,
        steps 2 and 3 for the second alone."""
        starts = [self.cache.lengths[s] for s in slots]
        depth = list(depths) if depths is not None else [tier] * len(slots)
        params = None if sampling is None else sampling.params.to(hidden.device)
        u = None if sampling is None else sampling.u.to(hidden.device)
        picked: list[list[Tensor]] = [[] for _ in slots]  # device scalars until the end
        drawn: list[list[tuple[Tensor, Tensor]]] = [[] for _ in slots]  # (ids, q) [K] each
        rows = list(range(len(slots)))  # the requests still drafting; `hidden` holds theirs
        for k in range(tier):
            going = [i for i, b in enumerate(rows) if depth[b] > k]
            if len(going) < len(rows):
                hidden, rows = hidden[going], [rows[i] for i in going]
            if not rows:
                break
            if params is None or u is None:
                tokens = self.greedy(hidden)
            else:
                logits, names = self.named_logits(hidden)
                tokens, ids, q = draft_support(logits, params.rows(rows), u[rows, k], names=names)
            for i, b in enumerate(rows):
                picked[b].append(tokens[i])
                if sampling is not None and not sampling.greedy[b]:
                    drawn[b].append((ids[i], q[i]))
            if any(k + 1 < depth[b] for b in rows):
                layout = BatchLayout.causal(
                    [slots[b] for b in rows], [starts[b] + k for b in rows], [1] * len(rows)
                )
                hidden = self._step(tokens[:, None], hidden, layout)
        steps = _split([t for row in picked for t in row], [len(r) for r in picked])
        qs: list[DraftQ | None] = [None] * len(slots)
        flat = [pair for row in drawn for pair in row]
        if flat:  # one copy of each, cut per request
            counts = [len(r) for r in drawn]
            ids = torch.stack([i for i, _ in flat]).cpu().split(counts)
            q = torch.stack([q for _, q in flat]).cpu().split(counts)
            qs = [(ids[b], q[b]) if c else None for b, c in enumerate(counts)]
        return steps, qs

    @torch.inference_mode()
    def prepare(self, request_ids: Sequence[str], state: SpecRuntimeState) -> None:
        """Plans these requests' next extend at `state`'s tier ahead of their tokens (a no-op
        for eager stages, or for an unknown request)."""
        entries = [self.requests.get(rid) for rid in request_ids]
        if entries and all(entries):
            self._stages(state)[0].prepare([e.slot for e in entries if e is not None])

    def _stages(self, state: SpecRuntimeState) -> tuple[ExtendStage, DraftStage]:
        extend = state.extend_stage()
        if extend.cache is not self.cache:
            raise RuntimeError("this state's draft stages were built for another drafter")
        return extend, state.draft_stage()
