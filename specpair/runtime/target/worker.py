"""The target's stages: prefill a prompt, verify candidate trees, accept, commit the KV.

A `TargetSequence` is one request on the target: its tokens, its KV slot and the *pending*
token (the last sampled one, not yet in the KV cache). Each verify forward runs the pending
token as the root of the request's candidate tree, so decoding without speculation is the same
call with an empty tree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specpair.models.llama import LlamaModel
from specpair.runtime.accept import Acceptance
from specpair.runtime.kv_cache import CacheFullError, KVCache
from specpair.runtime.layout import BatchLayout, eye_mask
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    make_generator,
    sample_rows,
    warp_rows,
)
from specpair.runtime.stages import DrawStage, PrefillStage, VerifyStage
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.accepting import accept_batch, uniforms
from specpair.runtime.target.features import host_rows
from specpair.runtime.target.verify import EagerVerify
from specpair.runtime.tree import CandidateTree, full_parents, tree_depths, tree_mask


@dataclass
class TargetSequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    slot: int = -1
    output: list[int] = field(default_factory=list)  # generated tokens (incl. the pending one)
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error"
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = make_generator(self.sampling.seed)

    @property
    def pending(self) -> int:
        return self.output[-1]

    @property
    def committed(self) -> int:
        """Tokens whose KV is in the cache: all but the pending one."""
        return len(self.prompt) + len(self.output) - 1

    def append(self, tokens: Sequence[int]) -> list[int]:
        """Adds newly generated tokens up to the first stop token or the length budget.

        Returns the tokens actually kept (what the client sees this round).
        """
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            if token in self.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.output) + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        self.output.extend(kept)
        return kept


@dataclass(frozen=True, slots=True)
class VerifyResult:
    acceptance: Acceptance
    new_tokens: list[int]  # accepted drafts + bonus, after stop/length truncation
    # [len(keep), F] features of the committed positions (EAGLE): the final hidden state
    # (F = H), or the outputs of the worker's `feature_layers` concatenated (EAGLE-3: F = 3H)
    features: Tensor | None


def kept_rows(hidden: Tensor, keeps: Sequence[Sequence[int]]) -> list[Tensor]:
    """hidden [B, T, F] (on the device) -> per request b its rows keeps[b] [n_b, F] on the host,
    gathered and read back in one copy: a read per request would cost the batch B index uploads
    and B synchronising reads a round (8 at batch 8). The rows are views of that one read, which
    each request's `FeatureLog` keeps as they are."""
    t = hidden.shape[1]
    flat = torch.tensor([b * t + j for b, keep in enumerate(keeps) for j in keep], dtype=torch.long)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat.to(hidden.device))
    return list(host_rows(rows).split([len(keep) for keep in keeps]))


class TargetWorker:
    """Target model + KV cache; the stages are synchronous (services call them via `Compute`)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        *,
        keep_features: bool = False,
        feature_layers: tuple[int, ...] = (),
        deterministic: bool = False,
    ):
        """`deterministic`: the batch-invariant mode, with its model and cache (`build_target`):
        a batch of prompts is one forward whose attention runs request by request
        (`SoloAttention`), and each first token is drawn from its own row alone."""
        self.model = model
        self.deterministic = deterministic
        self.cache = cache
        self.keep_features = keep_features or bool(feature_layers)
        self.feature_layers = feature_layers  # EAGLE-3: features are these layers' outputs
        self.device = model.lm_head.weight.device
        # the verify of plain decoding (no state)
        self.plain = EagerVerify(model, cache, feature_layers)
        # small prefills in CUDA graphs (`gpu/prefill_graphs.py`), set by `StateBuilder` on a GPU
        self.prefill_graphs: PrefillStage | None = None
        # sampled first tokens in CUDA graphs (`gpu/draw_graphs.py`), set there too
        self.draws: DrawStage | None = None
        self.last_gpu_ms = 0.0  # GPU time of the last verify's graph replays (0: none ran)
        self.last_rows = 0  # rows the last verify's forward computed, its padding included
        self.accept_paths: Counter[str] = Counter()  # verifies by `accepting.ACCEPT_PATHS`
        self.last_accept = ""  # the last verify's
        # `verify`'s riders: the padded verify rows (requests × tokens) a joining round may grow
        # to with prompts riding in it; 0: joiners are prefilled apart (`prefill`)
        self.ride_rows = 0
        self.rode: list[Tensor | None] = []  # the last verify's riders' features (`verify`)

    def _choose(self, seqs: Sequence[TargetSequence], logits: Tensor) -> list[int]:
        """Each request's next token from its logits row [B, V] on the device; the host reads
        the B tokens back. A sampling request draws one uniform from its own generator."""
        if all(s.sampling.greedy for s in seqs):
            return logits.argmax(-1).tolist()
        params = RowParams.of([s.sampling for s in seqs])
        u = torch.tensor([uniforms(s, 1)[0] for s in seqs])
        if self.draws is not None and (drawn := self.draws.run(logits, params, u)) is not None:
            return drawn
        return sample_rows(warp_rows(logits, params.to(self.device)), u.to(self.device)).tolist()

    @torch.inference_mode()
    def prefill(self, seqs: Sequence[TargetSequence]) -> list[Tensor | None]:
        """Runs the prompts, commits their KV and samples each first token.

        Returns per request the prompt's hidden states [P, H] (EAGLE features) or None.
        """
        lengths = [len(s.prompt) for s in seqs]
        for seq in seqs:
            if seq.slot < 0:
                seq.slot = self.cache.alloc()
        layout = BatchLayout.causal([s.slot for s in seqs], [0] * len(seqs), lengths)
        t = max(lengths)
        tokens = torch.zeros(len(seqs), t, dtype=torch.long)
        for b, seq in enumerate(seqs):
            tokens[b, : lengths[b]] = torch.tensor(seq.prompt)
        graphed = (
            None
            if self.prefill_graphs is None
            else self.prefill_graphs.run(layout, tokens, lengths)
        )
        if graphed is not None:  # padded to the graph's bucket: [B', T', F] and [B', V]
            feats, logits = graphed[0], graphed[1][: len(seqs)]
        else:
            positions = torch.arange(t).expand(len(seqs), t)
            hidden, feats = self._forward(tokens, positions, layout)
            last = hidden[torch.arange(len(seqs)), torch.tensor(lengths) - 1]
            logits = self.model.logits(last)
        if self.deterministic:  # a row at a time: the batched warp and draw are batch-shaped
            first = [self._choose([s], logits[b : b + 1])[0] for b, s in enumerate(seqs)]
        else:
            first = self._choose(seqs, logits)
        for b, seq in enumerate(seqs):
            self.cache.commit(seq.slot, 0, range(lengths[b]))
            seq.append([first[b]])
        if not self.keep_features:
            return [None] * len(seqs)
        features: list[Tensor | None] = [*kept_rows(feats, [range(n) for n in lengths])]
        return features

    def rides(
        self,
        state: SpecRuntimeState | None,
        batch: int,
        prompts: Sequence[int],
        beside: Sequence[int] = (),
    ) -> bool:
        """Whether prompts of these lengths may ride in the verify of `batch` requests at
        `state` (`verify`'s riders), prompts of lengths `beside` being prefilled meanwhile: a
        chain tier, not the batch-invariant mode, and their chunks growing the verify's graph
        by at most `ride_rows` padded rows (requests × tokens). At tier 7 a 110-token prompt is
        14 chunks of 8: with 8 requests the graph of 24 × 8 instead of 8 × 8, 128 rows more;
        with 47, 64 × 8 instead of 48 × 8 (`verify_buckets`); with 51, none fits: it is
        prefilled apart."""
        if self.ride_rows <= 0 or self.deterministic or state is None or state.tier == 0:
            return False
        if not state.is_chain:
            return False
        t, cache, stage = len(state.chain_parents), self.cache, self._stage(state)
        before = stage.padded(batch)
        after = stage.padded(batch + sum(-(-p // t) for p in prompts))
        if before is None or after is None or (after - before) * t > self.ride_rows:
            return False
        # A rider's chunks write up to its prompt's last chunk + T, and a verify that finds no
        # page fails the whole batch (a prefill only its own joiners): room for every request
        # growing a tree, every rider's prompt and the prompts prefilled before the verify, or
        # the riders are prefilled apart too.
        ps = cache.page_size
        pages = sum(-(-(p + t) // ps) for p in prompts) + batch * (-(-t // ps) + 1)
        pages += sum(-(-p // ps) for p in beside)
        return max(prompts) + t <= cache.max_len and pages <= len(cache.pages.free)

    @torch.inference_mode()
    def prepare(
        self,
        seqs: Sequence[TargetSequence],
        state: SpecRuntimeState,
        depths: Sequence[int] | None = None,
        riders: Sequence[TargetSequence] = (),
    ) -> None:
        """Plans the next verify of `seqs` (and `riders`' prompts) before its drafts exist (a
        no-op for eager stages); `depths`: each one's chain length where per-request tiers
        differ (default the tier's).

        Everything but the tokens is known once the previous round is accepted: positions,
        pages and the tier's chain mask. The target service calls this while the draft service
        computes the drafts, so the plan leaves the round's critical path; the verify that
        follows uses it when its trees are full chains of the tier (the usual round).
        """
        stage = self._stage(state)
        if not stage.plans_ahead or not state.is_chain:
            return  # a tree's mask is known only once it arrives
        if depths is None:
            parents = [list(state.chain_parents)] * len(seqs)
        else:
            parents = [list(range(-1, d)) for d in depths]
        rows = self._rows(seqs, parents, riders, state)
        try:
            positions, layout = self._layout(rows, state)
        except CacheFullError:
            return  # the verify itself reports it
        stage.prepare(positions, layout, self._plan_key(rows))

    @torch.inference_mode()
    def verify(
        self,
        seqs: Sequence[TargetSequence],
        trees: Sequence[CandidateTree],
        state: SpecRuntimeState | None = None,
        riders: Sequence[TargetSequence] = (),
    ) -> list[VerifyResult]:
        """One forward over every request's full tree (pending root + drafts), then accept.

        `state` supplies the tier's verify stage and precomputed chain mask (other trees get
        their own); without one (plain decoding) the forward runs eagerly.

        `riders` (allocated slots, nothing committed; `rides` said yes) are joining requests
        prefilled in the same forward, one read of the weights instead of two: each prompt as
        rows of the tier's chain length, chunk k at its slot from position k·T under the chain's
        causal mask. Every layer writes all rows' K/V before it attends, so a chunk sees the
        ones before it. Each rider's KV is committed and its first token drawn as `prefill`
        does; `rode` holds their prompts' features (as `prefill` returns them).
        """
        parents = [full_parents(tree) for tree in trees]
        rows = self._rows(seqs, parents, riders, state)
        t = max(len(par) for _, _, par in rows)
        tokens = torch.zeros(len(rows), t, dtype=torch.long)
        for i, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
            tokens[i, : len(tree) + 1] = torch.tensor((seq.pending, *tree.tokens))
        b = len(seqs)
        chunks = self._chunks(riders, state)
        for j, (r, start, n) in enumerate(chunks):
            tokens[b + j, :n] = torch.tensor(riders[r].prompt[start : start + n])
        stage = self._stage(state)
        if stage.planned_for(self._plan_key(rows)):
            hidden, logits = stage.run(tokens)  # planned by `prepare`
        else:
            positions, layout = self._layout(rows, state)
            hidden, logits = self._forward_tree(tokens, positions, layout, state)
        accs, self.last_accept = accept_batch(
            seqs, trees, logits[:b], t, stage.accept, self.deterministic
        )
        self.accept_paths[self.last_accept] += 1
        self.last_gpu_ms = stage.read_gpu_ms()  # the replay is done: its GPU time is readable
        self.last_rows = stage.rows
        keeps: list[Sequence[int]] = [acc.keep for acc in accs]
        keeps += [range(n) for _, _, n in chunks]
        feats: Sequence[Tensor | None] = (
            kept_rows(hidden, keeps) if self.keep_features else [None] * len(rows)
        )
        results = []
        for seq, acc, f in zip(seqs, accs, feats[:b], strict=True):
            self.cache.commit(seq.slot, seq.committed, acc.keep)
            results.append(VerifyResult(acc, seq.append([*acc.tokens, acc.bonus]), f))
        self.rode = self._seat(riders, chunks, logits[b:], feats[b:])
        return results

    def _seat(
        self,
        riders: Sequence[TargetSequence],
        chunks: Sequence[tuple[int, int, int]],
        logits: Tensor,
        feats: Sequence[Tensor | None],
    ) -> list[Tensor | None]:
        """The riders' prefill from their chunk rows' logits [C, T, V] and features: each KV
        committed, each first token drawn from its last prompt row; their features [P, F]."""
        if not riders:
            return []
        last = {r: (j, n - 1) for j, (r, _, n) in enumerate(chunks)}  # the last chunk wins
        at = torch.tensor([last[r] for r in range(len(riders))]).to(logits.device)
        first = self._choose(riders, logits[at[:, 0], at[:, 1]])
        for seq, token in zip(riders, first, strict=True):
            self.cache.commit(seq.slot, 0, range(len(seq.prompt)))
            seq.append([token])
        if not self.keep_features:
            return [None] * len(riders)
        pieces: list[list[Tensor]] = [[] for _ in riders]
        for (r, _, _), f in zip(chunks, feats, strict=True):
            assert f is not None
            pieces[r].append(f)
        return [torch.cat(p) for p in pieces]

    def _chunks(
        self, riders: Sequence[TargetSequence], state: SpecRuntimeState | None
    ) -> list[tuple[int, int, int]]:
        """The riders' prompts as chunks of the tier's chain length: (rider, start, rows)."""
        if not riders:
            return []
        if state is None or not state.is_chain:
            raise ValueError("riders need a chain tier's verify")
        t = len(state.chain_parents)
        return [
            (r, start, min(t, len(seq.prompt) - start))
            for r, seq in enumerate(riders)
            for start in range(0, len(seq.prompt), t)
        ]

    def _rows(
        self,
        seqs: Sequence[TargetSequence],
        parents: Sequence[Sequence[int]],
        riders: Sequence[TargetSequence],
        state: SpecRuntimeState | None,
    ) -> list[tuple[int, int, tuple[int, ...]]]:
        """A verify's rows, (slot, start, parents): each request's tree after its committed
        tokens, then the riders' chunks as chains from their starts."""
        rows = [(s.slot, s.committed, tuple(p)) for s, p in zip(seqs, parents, strict=True)]
        for r, start, n in self._chunks(riders, state):
            rows.append((riders[r].slot, start, tuple(range(-1, n - 1))))
        return rows

    def _layout(
        self, rows: Sequence[tuple[int, int, tuple[int, ...]]], state: SpecRuntimeState | None
    ) -> tuple[Tensor, BatchLayout]:
        """Positions [B, T] and the layout of `rows` (`_rows`), each tree after its start
        (CacheFullError when one does not fit)."""
        t = max(len(par) for _, _, par in rows)
        b = len(rows)
        positions = torch.zeros(b, t, dtype=torch.long)
        new_mask = eye_mask(t).expand(b, -1, -1).clone()
        for i, (slot, start, par) in enumerate(rows):
            n = len(par)
            if state is not None and par == state.chain_parents:
                new_mask[i, :n, :n] = state.chain_mask
                depths = list(state.chain_depths)
            else:
                new_mask[i, :n, :n] = tree_mask(list(par))
                depths = tree_depths(list(par))
            positions[i, :n] = torch.tensor(depths) + start
            self.cache.check_room(slot, start, t)
        layout = BatchLayout(
            torch.tensor([slot for slot, _, _ in rows]),
            torch.tensor([start for _, start, _ in rows]),
            new_mask,
        )
        return positions, layout

    def _plan_key(self, rows: Sequence[tuple[int, int, tuple[int, ...]]]) -> tuple[object, ...]:
        """What a verify plan depends on: slots, starts, tree shapes, page tables."""
        return tuple(rows), self.cache.generation

    def _stage(self, state: SpecRuntimeState | None) -> VerifyStage:
        stage = self.plain if state is None else state.verify_stage()
        if stage.cache is not self.cache:
            raise RuntimeError("this state's verify stage was built for another target worker")
        return stage

    def _forward_tree(
        self, tokens: Tensor, positions: Tensor, layout: BatchLayout, state: SpecRuntimeState | None
    ) -> tuple[Tensor, Tensor]:
        """hidden [B, T, H] and float logits [B, T, V]: a captured graph of the tier if one fits."""
        stage = self._stage(state)
        stage.plan(positions, layout)
        return stage.run(tokens)

    def _forward(
        self, tokens: Tensor, positions: Tensor, layout: BatchLayout
    ) -> tuple[Tensor, Tensor]:
        """Final hidden states [B, T, H] and features (`LlamaModel.forward_aux`)."""
        args = (tokens.to(self.device), positions.to(self.device), self.cache.bind(layout))
        return self.model.forward_aux(*args, self.feature_layers)

    def release(self, seq: TargetSequence) -> None:
        if seq.slot >= 0:
            self.cache.free(seq.slot)
            seq.slot = -1
