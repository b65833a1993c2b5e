"""The draft's side of pipelined rounds: draft round n + 1 while the target verifies round n.

After answering round n with a chain of s tokens per request, the draft knows the outcomes the
target's verify can have: k of the s drafts accepted (0…s), then a bonus token. For the likeliest
outcomes under its own distributions (`likely_outcomes`) it forks the request's KV slot at the
accepted length (`KVCache.fork`: shared pages, nothing recomputed), extends the fork with the
guessed bonus and drafts the next chain there — every outcome of every request in one batch —
and sends those trees (`Predraft`) while the target verifies. The target looks its actual
outcome up: on a hit the next round's verify starts at once, and the next RoundRequest marks the
input `predrafted`; the draft then goes on from that fork (`adopt`) and frees the others. On a
miss the round runs as an unpipelined one and the forks are freed.

An EAGLE fork extends with the head's own predicted feature where the target's is not known
yet; on adoption the accepted rows are extended again with the target's true features, so only
the pre-drafted chain itself was drafted from predictions. Verification is unchanged, so output
is the same whatever is pre-drafted: a pre-draft only decides how soon a tree is there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specpair.logging import get_logger
from specpair.runtime.draft.drafter import Drafter, DraftSlot
from specpair.runtime.kv_cache import CacheFullError
from specpair.runtime.lookahead import LOOKAHEAD_TOP, Lookahead
from specpair.runtime.round import DraftInput, Predraft
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.tree import CandidateTree

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    accepted: int  # k drafts accepted, then
    bonus: int  # this token from the target
    p: float  # its probability under the draft's own distributions


class AcceptRates:
    """How often the target accepts the draft's token at each depth, given it accepted the ones
    before: counted from the outcomes the target reports (the next round's appended tokens),
    with one accept and one reject as a prior. Greedy acceptance is argmax agreement, which
    the draft's own probability does not tell: a flat draft distribution of a token the target
    agrees with is still accepted every time."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.reached: list[int] = []

    def observe(self, depth: int, accepted: int) -> None:
        """A chain of `depth` drafts of which the first `accepted` were kept."""
        while len(self.reached) < depth:
            self.accepted.append(0)
            self.reached.append(0)
        for j in range(min(accepted + 1, depth)):
            self.reached[j] += 1
            self.accepted[j] += j < accepted

    def rate(self, j: int) -> float:
        if j >= len(self.reached):
            return 0.5
        return (self.accepted[j] + 1) / (self.reached[j] + 2)


def likely_outcomes(
    chain: Sequence[int], ahead: Lookahead, n: int, rates: AcceptRates | None = None
) -> list[Outcome]:
    """The `n` likeliest outcomes of verifying `chain`: the chance the target accepts the
    draft at depth j is `rates.rate(j)` (default: the draft's own probability of its token);
    where it rejects, the bonus is one of the draft's other tokens there, in its proportions.

    Worked example, with the draft's own probabilities: chain [7, 9], the draft gave 7 p 0.6
    (else 4: 0.3), 9 p 0.9 (else 2: 0.1), and after the chain 5: 0.8. P(k = 0, bonus 4) =
    0.4 × 0.3 / 0.4 = 0.3; P(k = 1, bonus 2) = 0.6 × 0.1 × 0.1 / 0.1 = 0.06;
    P(k = 2, bonus 5) = 0.6 × 0.9 × 0.8 = 0.432. So n = 2 gives (2, 5) and (0, 4).
    """
    s = len(chain)
    out: list[Outcome] = []
    reach = 1.0  # P(the first k drafts are accepted)
    for k in range(s + 1):
        ids, ps = ahead.ids[k].tolist(), ahead.p[k].tolist()
        if k == s:
            out += [Outcome(s, b, reach * p) for b, p in zip(ids, ps, strict=True)]
            break
        own = dict(zip(ids, ps, strict=True)).get(chain[k], 0.0)
        accept = rates.rate(k) if rates is not None else own
        rest = max(1.0 - own, 1e-9)  # the draft's mass on the other tokens
        out += [
            Outcome(k, b, reach * (1.0 - accept) * p / rest)
            for b, p in zip(ids, ps, strict=True)
            if b != chain[k]
        ]
        reach *= accept
    out.sort(key=lambda o: -o.p)
    return out[:n]


@dataclass(slots=True)
class Fork:
    key: str  # the drafter's request id of the forked slot
    tree: CandidateTree
    ahead: Lookahead
    base: int  # committed length in the fork after the bonus: where its chain starts


@dataclass(slots=True)
class Drafted:
    """A request's last chain (sent, or pre-drafted and adopted) and its forks."""

    chain: tuple[int, ...]
    ahead: Lookahead
    base: int  # the request's committed length before the chain
    forks: dict[tuple[int, ...], Fork] = field(default_factory=dict)  # appended → fork


class Pipeline:
    """Lookaheads and forks of a drafter's requests. `width`: forks per round for the whole
    batch, within the free slots (the draft's batch is nearly free up to a width); each
    request gets an equal share, at least one while the width lasts."""

    def __init__(self, drafter: Drafter, width: int, top: int = LOOKAHEAD_TOP) -> None:
        self.drafter, self.width, self.top = drafter, width, top
        self.drafted: dict[str, Drafted] = {}
        self.rates = AcceptRates()
        self.hits = self.misses = 0  # adoptions the draft could and could not serve
        self.predraft_s, self.predraft_rounds = 0.0, 0  # time in `predraft`, and its calls
        # per stream ("" in process): the inputs whose outcomes it pre-drafts next, at a tier
        self._promised: dict[str, tuple[tuple[DraftInput, ...], SpecRuntimeState]] = {}

    def reset_counters(self) -> None:
        self.hits = self.misses = self.predraft_rounds = 0
        self.predraft_s = 0.0

    def promise(self, stream: str, inputs: Sequence[DraftInput], state: SpecRuntimeState) -> None:
        """The round just drafted for `stream` asked for pre-drafts: `ahead` makes them."""
        self._promised[stream] = (tuple(inputs), state)

    def forget(self, stream: str) -> None:
        """No pre-draft is owed to `stream` (a new round, a failed one, or its end)."""
        self._promised.pop(stream, None)

    def ahead(self, stream: str, round_id: int) -> dict[str, tuple[Predraft, ...]] | None:
        """The pre-drafts promised to `stream` (None: none were), keyed as drafted; {} when
        the forks find no room (only these guesses are lost)."""
        promised = self._promised.pop(stream, None)
        if promised is None:
            return None
        try:
            return self.predraft(*promised)
        except CacheFullError as exc:
            log.warning("pre-draft skipped", round_id=round_id, error=str(exc))
            return {}

    def release(self, request_id: str) -> None:
        self._drop_forks(request_id)
        self.drafted.pop(request_id, None)
        self.drafter.release(request_id)

    def _drop_forks(self, request_id: str, keep: str = "") -> None:
        entry = self.drafted.get(request_id)
        if entry is not None:
            for fork in entry.forks.values():
                if fork.key != keep:
                    self.drafter.release(fork.key)
            entry.forks = {}

    @torch.inference_mode()
    def adopt(self, item: DraftInput, state: SpecRuntimeState) -> bool:
        """Goes on from the fork the target verifies (`item.predrafted`); False when there is
        none (the request's state is dropped: the target re-sends its history later)."""
        entry = self.drafted.get(item.request_id)
        fork = entry.forks.get(item.appended) if entry is not None else None
        if entry is None or fork is None:
            self.misses += 1
            self.release(item.request_id)
            return False
        self._drop_forks(item.request_id, keep=fork.key)
        self._take_over(item.request_id, fork.key)
        if self.drafter.needs_features:
            # Again with the target's features: the fork extended its bonus with a guess.
            slot = self.drafter.requests[item.request_id].slot
            self.drafter.cache.truncate(slot, entry.base)
            if item.sampling.greedy:
                state.extend_stage().run([item], [slot])  # a graph where one fits
            else:
                self.drafter.extend([item], [slot])
            assert self.drafter.cache.lengths[slot] == fork.base
        self.drafted[item.request_id] = Drafted(fork.tree.tokens, fork.ahead, fork.base)
        self.hits += 1
        return True

    def _take_over(self, request_id: str, key: str) -> None:
        """The request goes on in its fork `key`'s slot; the slot it had is freed."""
        fork = self.drafter.requests.pop(key)
        self.drafter.release(request_id)
        self.drafter.requests[request_id] = fork

    def _fork(self, births: Sequence[tuple[str, str, int]]) -> None:
        """Each (parent id, fork id, length): the fork starts as the parent's first `length`
        positions (`KVCache.fork_many`: shared pages) and draws from the parent's generator."""
        parents = [self.drafter.requests[parent_id] for parent_id, _, _ in births]
        slots = self.drafter.cache.fork_many(
            [(p.slot, n) for p, (_, _, n) in zip(parents, births, strict=True)]
        )
        for parent, slot, (_, key, _) in zip(parents, slots, births, strict=True):
            self.drafter.requests[key] = DraftSlot(slot, parent.generator)

    @torch.inference_mode()
    def begin(self, inputs: Sequence[DraftInput], state: SpecRuntimeState) -> list[str]:
        """A round's first step, before anything is drafted or a slot counted: adopts the forks
        of `predrafted` inputs and frees every other fork of the round's requests. Returns the
        ids adopted."""
        adopted = []
        for item in inputs:
            entry = self.drafted.get(item.request_id)
            if entry is not None and entry.chain and len(item.appended) <= len(entry.chain) + 1:
                self.rates.observe(len(entry.chain), len(item.appended) - 1)
            if item.predrafted:
                if self.adopt(item, state):
                    adopted.append(item.request_id)
            else:
                self._drop_forks(item.request_id)
        return adopted

    @torch.inference_mode()
    def draft(self, inputs: Sequence[DraftInput], state: SpecRuntimeState) -> list[CandidateTree]:
        """Fresh chains (an unpipelined round's draft), each remembered with its lookahead."""
        drafted = self.drafter.draft_ahead(inputs, state, self.top)
        for item, (tree, ahead) in zip(inputs, drafted, strict=True):
            slot = self.drafter.requests[item.request_id].slot
            base = self.drafter.cache.lengths[slot]
            self.drafted[item.request_id] = Drafted(tree.tokens, ahead, base)
        return [tree for tree, _ in drafted]

    @torch.inference_mode()
    def predraft(
        self, inputs: Sequence[DraftInput], state: SpecRuntimeState
    ) -> dict[str, tuple[Predraft, ...]]:
        """Trees for the likeliest outcomes of the chains just sent for `inputs` (request ids as
        given), drafted in one batch of forks."""
        entries = [(i, self.drafted[i.request_id]) for i in inputs if i.request_id in self.drafted]
        if not entries or state.tier == 0:
            return {}
        cache = self.drafter.cache
        budget = min(self.width, cache.free_slots)
        share = max(1, budget // len(entries))
        forks: list[tuple[str, tuple[int, ...], Outcome]] = []
        fork_inputs: list[DraftInput] = []
        births: list[tuple[str, str, int]] = []  # (parent, fork, length)
        for item, entry in entries:
            depth = item.steps or state.tier
            if len(entry.chain) != depth:
                continue  # a chain cut short (the cache's end): nothing to go on from
            for o in likely_outcomes(entry.chain, entry.ahead, share, self.rates):
                if len(forks) == budget or entry.base + o.accepted + 2 * depth + 2 > cache.max_len:
                    break
                key = f"{item.request_id}>{o.accepted}:{o.bonus}"
                births.append((item.request_id, key, entry.base + o.accepted))
                appended = (*entry.chain[: o.accepted], o.bonus)
                feature = entry.ahead.hidden[o.accepted : o.accepted + 1]
                fork_inputs.append(
                    replace(item, request_id=key, appended=(o.bonus,), features=feature)
                )
                forks.append((item.request_id, appended, o))
        if not fork_inputs:
            return {}
        t0 = time.perf_counter()
        self._fork(births)
        drafted = self.drafter.draft_ahead(fork_inputs, state, self.top)
        out: dict[str, list[Predraft]] = {}
        for (rid, appended, o), fork_input, (tree, ahead) in zip(
            forks, fork_inputs, drafted, strict=True
        ):
            base = cache.lengths[self.drafter.requests[fork_input.request_id].slot]
            self.drafted[rid].forks[appended] = Fork(fork_input.request_id, tree, ahead, base)
            out.setdefault(rid, []).append(Predraft(o.accepted, o.bonus, tree))
        self.predraft_s += time.perf_counter() - t0  # the trees are on the host: GPU work done
        self.predraft_rounds += 1
        return {rid: tuple(p) for rid, p in out.items()}
