"""Assemble the in-process pieces from checkpoint paths (engine demo, tests, benchmarks).

On a CUDA device the model is fused (`fused.py`); the cache is the same paged cache on every
device. Build the workers first, then the states with them (`StateBuilder(worker, drafter)`,
which captures CUDA graphs for a GPU worker), as the services do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from specpair.capabilities import Device, Draft, Modes, Tiers, check, refusal
from specpair.logging import get_logger
from specpair.models.args import ModelArgs
from specpair.models.eagle import EagleHead
from specpair.models.eagle3 import Eagle3Head
from specpair.models.eagle3_loading import aux_layers, load_eagle3
from specpair.models.loading import (
    CheckpointError,
    eagle_layout,
    load_eagle,
    load_llama,
    read_args,
)
from specpair.models.token_map import load_token_map
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.drafters import EagleDrafter, LMDrafter
from specpair.runtime.draft.eager import EagerDraft, EagerExtend
from specpair.runtime.gpu.capture import GraphCapture
from specpair.runtime.gpu.draft_graphs import DraftGraphs, HandoffExtend
from specpair.runtime.gpu.draw_graphs import DrawGraphs
from specpair.runtime.gpu.prefill_graphs import PrefillGraphs
from specpair.runtime.gpu.tree_graphs import tree_stages
from specpair.runtime.gpu.verify_graphs import VerifyGraphs
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.shape import TreeShape
from specpair.runtime.stages import DraftStage, ExtendStage, VerifyStage
from specpair.runtime.state import SpecRuntimeState, tier_state
from specpair.runtime.target.verify import EagerVerify
from specpair.runtime.target.worker import TargetWorker

log = get_logger(__name__)

Tier = TypeVar("Tier", int, TreeShape)  # how a caller names its tiers: chain steps, or shapes


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def make_cache(
    args: ModelArgs,
    *,
    max_requests: int,
    max_len: int,
    dtype: torch.dtype,
    device: str,
    invariant: bool = False,
) -> KVCache:
    return KVCache.for_model(
        args,
        max_requests=max_requests,
        max_len=max_len,
        dtype=dtype,
        device=device,
        invariant=invariant,
    )


def gpu_target(worker: TargetWorker) -> TargetWorker:
    """Fuses the target's decoder for the GPU (batch-invariant if the worker is)."""
    from specpair.runtime.gpu.fused import fuse_decoder

    fuse_decoder(worker.model, invariant=worker.deterministic)
    return worker


def gpu_drafter(drafter: Drafter) -> Drafter:
    """Fuses the drafter's decoder (an EAGLE head's layer, or the LM) for the GPU."""
    from specpair.runtime.gpu.fused import fuse_decoder

    if isinstance(drafter, EagleDrafter):
        fuse_decoder(drafter.head)
    elif isinstance(drafter, LMDrafter):
        fuse_decoder(drafter.model)
    return drafter


def build_target(
    path: str | Path,
    *,
    max_requests: int,
    max_len: int,
    keep_features: bool = False,
    feature_layers: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    deterministic: bool = False,
) -> TargetWorker:
    """`feature_layers`: an EAGLE-3 draft's (`eagle3_loading.aux_layers`): every forward
    (prefill, verify, its graphs) returns those layers' outputs as the features.
    `deterministic`: the batch-invariant mode (a GPU's; see `TargetWorker`)."""
    check(Modes(device=Device.of(str(device)), deterministic=deterministic))
    model = load_llama(path, dtype=dtype, device=device, context=max_len)
    cache = make_cache(
        model.args,
        max_requests=max_requests,
        max_len=max_len,
        dtype=dtype,
        device=device,
        invariant=deterministic,
    )
    worker = TargetWorker(
        model,
        cache,
        keep_features=keep_features,
        feature_layers=feature_layers,
        deterministic=deterministic,
    )
    return gpu_target(worker) if _is_cuda(device) else worker


def feature_layers(draft_path: str | Path, target_path: str | Path) -> tuple[int, ...]:
    """The target layers whose outputs an EAGLE-3 draft reads; () for any other draft (an
    EAGLE-1/2 head reads the final hidden state, a draft LM nothing)."""
    if eagle_layout(draft_path) != "eagle3":
        return ()
    return aux_layers(draft_path, read_args(target_path).num_layers)


def check_drafter(
    path: str | Path, target_path: str | Path | None, token_map: str | Path | None
) -> str | None:
    """The draft checkpoint's EAGLE layout (None: a draft LM), its modes checked against
    `capabilities` (only the files say whether a head is EAGLE-3); CheckpointError names the
    checkpoint and the field."""
    layout = eagle_layout(path)
    kind = Draft.MODEL if layout is None else Draft.EAGLE3 if layout == "eagle3" else Draft.EAGLE
    modes = Modes(draft=kind, token_map=token_map is not None, target_model=target_path is not None)
    if (refused := refusal(modes)) is not None:
        raise CheckpointError(f"{path}: {refused.message}")
    return layout


def build_drafter(
    path: str | Path,
    *,
    target_path: str | Path | None,
    max_requests: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    token_map: str | Path | None = None,
) -> Drafter:
    """An EAGLE drafter when `path` is an EAGLE head (needs `target_path`), else a standalone LM.
    `token_map`: the ids an EAGLE-1/2 head drafts over (`models/draft_vocab.py`)."""
    drafter: Drafter
    layout = check_drafter(path, target_path, token_map)
    if layout is not None:
        assert target_path is not None  # check_drafter: an EAGLE head needs it
        head: EagleHead | Eagle3Head
        if layout == "eagle3":
            head = load_eagle3(path, target_path, dtype=dtype, device=device, context=max_len)
        else:
            ids = None
            if token_map is not None:
                ids = load_token_map(token_map, read_args(target_path).vocab_size)
            head = load_eagle(
                path, target_path, dtype=dtype, device=device, context=max_len, token_map=ids
            )
        cache = make_cache(
            head.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
        drafter = EagleDrafter(head, cache)
    else:
        model = load_llama(path, dtype=dtype, device=device, context=max_len)
        cache = make_cache(
            model.args, max_requests=max_requests, max_len=max_len, dtype=dtype, device=device
        )
        drafter = LMDrafter(model, cache)
    return gpu_drafter(drafter) if _is_cuda(device) else drafter


class StateBuilder:
    """Builds the states of `target` and/or `drafter` (a worker whose cache is on a GPU gets
    CUDA graphs per bucket: `buckets`, or powers of two up to its cache's slots; a drafter's
    tier 0, a prompt hand-off, graphs of `handoff_rows` rows where that is positive)."""

    def __init__(
        self,
        target: TargetWorker | None = None,
        drafter: Drafter | None = None,
        *,
        buckets: Sequence[int] | None = None,
        handoff_rows: int = 0,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.handoff_rows = handoff_rows
        self.builds = 0
        self.target_graphs: GraphCapture | None = None
        self.draft_graphs: DraftGraphs | None = None
        if target is not None and target.cache.device.type == "cuda":
            slots = len(target.cache.lengths)
            self.target_graphs = GraphCapture(target.cache, slots, "target", buckets)
            if not target.deterministic and target.cache.attention.flashinfer_serves:
                target.prefill_graphs = PrefillGraphs(
                    self.target_graphs, target.model, target.feature_layers
                )
            if not target.deterministic:  # that mode draws a row at a time, eagerly
                target.draws = DrawGraphs(self.target_graphs, target.model.args.vocab_size)
        if drafter is not None and drafter.cache.device.type == "cuda":
            slots = len(drafter.cache.lengths)
            capture = GraphCapture(drafter.cache, slots, "draft", buckets)
            self.draft_graphs = DraftGraphs(capture, drafter)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        draft = None if self.draft_graphs is None else self.draft_graphs.capture
        return sum(g.captures for g in (self.target_graphs, draft) if g is not None)

    def build(self, tier: int | TreeShape) -> SpecRuntimeState:
        """The tier's state (s: the chain of s drafts; or a tree shape), its stages complete
        (graphs captured). On a GPU a tree verifies in graphs of its num_draft_tokens + 1 rows,
        extends in its depth's graphs (a chain's of the same steps) and drafts in graphs of its
        own where its steps fit the Triton tree kernel (`gpu/tree_graphs.py`), else eagerly."""
        shape = tier if isinstance(tier, TreeShape) else TreeShape(tier)
        if self.target is not None:
            tiers = Tiers.CHAINS if shape.is_chain else Tiers.TREES
            check(Modes(deterministic=self.target.deterministic, tiers=tiers))
        verify: VerifyStage | None = None
        extend: ExtendStage | None = None
        draft: DraftStage | None = None
        if self.target is not None:
            t = self.target
            verify = EagerVerify(t.model, t.cache, t.feature_layers)
            if self.target_graphs is not None:
                verify = VerifyGraphs(self.target_graphs, t.model, shape, verify, t.feature_layers)
        if self.drafter is not None:
            extend, draft = EagerExtend(self.drafter), EagerDraft(self.drafter, shape)
            if (graphs := self.draft_graphs) is not None and shape.steps > 0:
                if shape.is_chain:
                    extend, draft = graphs.tier(shape.steps, extend, draft)
                else:
                    extend, draft = tree_stages(graphs, shape, extend, draft)
            elif graphs is not None and self.handoff_rows > 0:
                extend = HandoffExtend(graphs, self.handoff_rows, extend)
        self.builds += 1
        return tier_state(shape, verify, extend, draft)

    def build_all(self, tiers: Iterable[Tier]) -> dict[Tier, SpecRuntimeState]:
        """One state per candidate tier, keyed as given (ints for chains, or `TreeShape`s) —
        called once, at start-up; logs each one's build time."""
        states = {}
        for tier in sorted(set(tiers)):
            t0 = time.perf_counter()
            states[tier] = self.build(tier)
            ms = round(1e3 * (time.perf_counter() - t0), 2)
            log.info("built runtime state", tier=str(tier), ms=ms)
        return states


def build_states(
    tiers: Iterable[Tier],
    target: TargetWorker | None = None,
    drafter: Drafter | None = None,
    *,
    buckets: Sequence[int] | None = None,
) -> dict[Tier, SpecRuntimeState]:
    """`StateBuilder(target, drafter).build_all(tiers)`, for callers that count nothing."""
    return StateBuilder(target, drafter, buckets=buckets).build_all(tiers)
