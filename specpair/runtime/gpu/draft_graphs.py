"""The draft's stages in CUDA graphs, per batch bucket: extend, then s steps (what each graph
computes is `draft_capture.py`; here, their planning, replay and eager fallback; the steps'
are `step_graphs.py`'s).

- extend: B × (s + 1) appended tokens (accepted + bonus; longer rows, e.g. a first round's
  prompt, run eagerly) → hidden of each request's last row [B, 1, H];
- draft: s steps of one token per request → tokens [s, B], greedy or sampled.
The graphs of every tier share one `DraftGraphs` (the extend graphs, the steps' attention and
the plan made ahead), so a tier switch stays a reference swap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.gpu.capture import (
    GraphAttention,
    GraphCapture,
    StageGraph,
    bucket_of,
    pad2d,
    pad_layout,
)
from specpair.runtime.gpu.draft_capture import extend_graph, step_graph
from specpair.runtime.gpu.step_graphs import StepGraphs
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.layout import BatchLayout, padded_groups, tril_mask
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.stages import DraftModel, DraftStage, ExtendStage


class DraftGraphs:
    """A drafter's graphs of every tier: extends by (bucket, tokens), step attention by bucket
    (step k's is the same whatever the tier), the extend planned ahead."""

    def __init__(self, capture: GraphCapture, model: DraftModel) -> None:
        self.capture, self.model, self.cache = capture, model, capture.cache
        self.steps: dict[int, list[GraphAttention]] = {b: [] for b in capture.buckets}
        self.extends: dict[tuple[int, int], StageGraph] = {}
        self.planned: tuple[object, StageGraph] | None = None  # (key, extend) from `prepare`
        self.steps_paged = False  # the extend ran on a plan ahead, which paged the steps too

    def tier(
        self, s: int, eager_extend: ExtendStage, eager_draft: DraftStage
    ) -> tuple[ExtendGraphs, StepGraphs]:
        """Tier s's stages; where no graph fits they run `eager_extend` / `eager_draft`."""
        Graphs = dict[int, StageGraph]

        def build() -> tuple[Graphs, Graphs]:
            buckets = self.capture.buckets
            self.extend_graphs(s + 1)
            steps = {b: self._multi_step(b, s) for b in buckets}
            sampled = {b: self._multi_step(b, s, sampled=True) for b in buckets}
            return steps, sampled

        steps, sampled = self.capture.timed(str(s), build)
        return ExtendGraphs(self, s, eager_extend), StepGraphs(self, s, eager_draft, steps, sampled)

    def extend_graphs(self, width: int) -> None:
        """Each bucket's extend graph of `width` rows, unless a tier of that width has one."""
        for b in self.capture.buckets:
            if (b, width) not in self.extends:
                self.extends[(b, width)] = extend_graph(self.capture, self.model, b, width)

    def _multi_step(self, batch: int, s: int, sampled: bool = False) -> StageGraph:
        """`step_graph` of s steps over the bucket's shared step attention, grown to as many
        forwards as the graph runs."""
        attns = self.steps[batch]
        forwards = s - 1
        while len(attns) < forwards:
            attns.append(self.capture.attention(batch, 1))
            attns[-1].share_pages(attns[0])
        return step_graph(self.capture, self.model, attns[:forwards], batch, s, sampled)

    def plan_step_pages(self, bucket: int, slots: list[int], ends: list[int]) -> None:
        """Pages up to `ends` and their rows, for steps that place themselves (`on_device`)."""
        attns = self.steps[bucket]
        if not attns or not attns[0].on_device:
            return
        for slot, end in zip(slots, ends, strict=True):
            self.cache.reserve(slot, end)
        attns[0].plan_pages(slots)

    def replay_extend(
        self, ext: StageGraph, tokens: Tensor, feats: list[FeatureRows] | None, lengths: list[int]
    ) -> Tensor:
        """Replays `ext`, planned for these rows (`extend_inputs`' tokens [B, t], features and
        lengths), padded to its bucket and width: each request's last hidden [bucket, 1, H]."""
        bucket, width = ext.inputs["tokens"].shape
        ext.load("tokens", pad2d(tokens, bucket, width))
        last = torch.zeros(bucket, dtype=torch.long)
        last[: len(lengths)] = torch.tensor(lengths) - 1
        ext.load("last", last)
        if feats is not None:
            ext.load_rows("features", feats)
        self.capture.replay(ext)
        return ext.outputs["hidden"]

    def plan_extend(self, ext: StageGraph, slots: list[int], starts: list[int]) -> None:
        """An extend graph's attention and positions for requests appending after `starts`: a
        causal block of the graph's width per request (rows past a request's own are padding
        whose K/V the draft steps overwrite), positions start + [0, width)."""
        bucket, width = ext.inputs["tokens"].shape
        b = len(slots)
        layout = BatchLayout(
            torch.tensor(slots), torch.tensor(starts), tril_mask(width).expand(b, -1, -1)
        )
        ext.attention[0].plan(pad_layout(layout, bucket, width, self.cache.pad_slot))
        ext.load("positions", pad2d(layout.starts[:, None] + torch.arange(width), bucket, width))


class ExtendGraphs:
    """One tier's extend stage: the bucket's graph of s + 1 rows (or the narrowest wider one
    that fits), planned ahead by `prepare` or in line; else the drafter's eager extend."""

    plans_ahead = True

    def __init__(self, graphs: DraftGraphs, tier: int, eager: ExtendStage) -> None:
        self.graphs, self.tier, self.cache, self.eager = graphs, tier, graphs.cache, eager
        self.ahead = 0  # extends that ran on a plan made ahead

    def prepare(self, slots: list[int]) -> None:
        """Plans the next round's extend of `slots` before its tokens arrive: pages, starts
        and positions follow from the committed lengths; only tokens (and features) and each
        request's last row depend on the target's verdict. The draft service calls this while
        the target verifies; the next round uses the plan when its slots and starts match."""
        o, cache, s = self.graphs, self.graphs.cache, self.tier
        o.planned = None
        bucket = bucket_of(len(slots), o.capture.buckets)
        if bucket is None:
            return
        ext = o.extends.get((bucket, s + 1))
        starts = [cache.lengths[slot] for slot in slots]
        if ext is None or max(starts) + 2 * s + 1 > cache.max_len:
            return  # the round runs eagerly
        try:
            with o.capture.staging.deferred():
                o.plan_extend(ext, slots, starts)
                # the steps write after the extend's rows: at most s + 1 + s past the start
                o.plan_step_pages(bucket, slots, [st + 2 * s + 1 for st in starts])
        except CacheFullError:
            return  # the round itself reports it
        o.planned = ((s, tuple(slots), tuple(starts), cache.generation), ext)

    def run(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        o, cache, d = self.graphs, self.graphs.cache, self.graphs.model
        bucket = bucket_of(len(inputs), o.capture.buckets)
        planned, o.planned = o.planned, None
        o.steps_paged = False
        starts = [cache.lengths[slot] for slot in slots]
        widths = [len(item.appended) for item in inputs]
        groups = padded_groups(starts, widths, cache.max_len)
        if len(groups) > 1:
            # Every row of one forward is padded to the longest: a prompt joining beside a
            # request deep into its context would write that request's slot past the cache,
            # and the draft refuse the round (then the next round re-sends every request
            # whole), and every short row would be padded to the prompt. Each group runs
            # alone: the rounds' short rows in a graph, the prompt eagerly.
            return self._grouped(inputs, slots, groups)
        if bucket is None:
            return self.eager.run(inputs, slots)
        tokens, feats, positions, layout, lengths = d.extend_inputs(inputs, slots)
        t = tokens.shape[1]
        ext = None
        key = (self.tier, tuple(slots), tuple(starts), cache.generation)
        if planned is not None and planned[0] == key and planned[1].inputs["tokens"].shape[1] >= t:
            ext = planned[1]  # planned by `prepare`, with the steps' pages
            self.ahead += 1
            o.steps_paged = True
        fits = sorted(k[1] for k in o.extends if k[0] == bucket and k[1] >= t)
        if ext is None and fits and max(starts) + fits[0] <= cache.max_len:
            ext = o.extends[(bucket, fits[0])]
            o.plan_extend(ext, slots, starts)
        if ext is None:
            return d.extend_forward(tokens, feats, positions, layout, lengths)
        return o.replay_extend(ext, tokens, feats, lengths)

    def _grouped(
        self, inputs: Sequence[DraftInput], slots: list[int], groups: list[list[int]]
    ) -> Tensor:
        """`run` on each of `groups` (one forward each), stitched back: [B, 1, H]."""
        out: Tensor | None = None
        for group in groups:
            # A graph's output is its static buffer: copied out before the next group runs.
            hidden = self.run([inputs[i] for i in group], [slots[i] for i in group])
            if out is None:
                out = hidden.new_empty(len(inputs), *hidden.shape[1:])
            out[group] = hidden[: len(group)]
        assert out is not None
        return out


class HandoffExtend:
    """Tier 0's extend, a target's prompt hand-off (`DraftSession.handoff`: the last `width`
    tokens of each joiner's prompt with a draft window), in the bucket's extend graph of
    `width` rows, planned in line; a wider hand-off, or one whose padding would pass a slot's
    end, runs eagerly. Eagerly a hand-off of 32 EAGLE-3 rows costs the draft milliseconds of
    launches on the way to the target's next round (an H200 at 8 clients: 0.83-1.33 ms a round
    of the target's hand-off against 0.33 in graphs, bench/RESULTS.md "hand-offs in CUDA
    graphs"). It never replays the graph holding the plan a tier made ahead
    (`DraftGraphs.planned`): a hand-off comes between that plan and its round."""

    plans_ahead = False
    ahead = 0

    def __init__(self, graphs: DraftGraphs, width: int, eager: ExtendStage) -> None:
        self.graphs, self.width, self.cache, self.eager = graphs, width, graphs.cache, eager
        graphs.capture.timed(f"hand-off {width}", lambda: graphs.extend_graphs(width))

    def prepare(self, slots: list[int]) -> None:
        return None

    def run(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        o, cache = self.graphs, self.cache
        bucket = bucket_of(len(inputs), o.capture.buckets)
        ext = None if bucket is None else o.extends.get((bucket, self.width))
        starts = [cache.lengths[slot] for slot in slots]
        held = None if o.planned is None else o.planned[1]
        wide = max(len(item.appended) for item in inputs) > self.width
        if ext is None or ext is held or wide or max(starts) + self.width > cache.max_len:
            return self.eager.run(inputs, slots)
        tokens, feats, _, _, lengths = o.model.extend_inputs(inputs, slots)
        o.plan_extend(ext, slots, starts)
        return o.replay_extend(ext, tokens, feats, lengths)
