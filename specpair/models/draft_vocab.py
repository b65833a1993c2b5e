"""A draft vocabulary: the target ids a head may draft, and its token map file.

An EAGLE-3 head ships its own (`d2t`); an EAGLE-1/2 head may be given one: a frequency-ranked
token map (FR-Spec, SGLang's `--speculative-token-map`), whose LM head keeps only those rows of
the target's. A draft step then reads N × H of the head instead of V × H: Llama-3 with a 32 768-id
map reads 0.27 of its 1.05 GB in bf16.

Draft id i is target id `i + d2t[i]`, target ids ascending. Worked example: the map [0, 2, 5]
gives d2t = [0, 1, 3]. Lossless as any draft is: the verify does not change; greedy drafts the
best mapped id; a sampled draft's q is its warped distribution over the mapped ids, zero
elsewhere, so rejection sampling against the target's p stays exact (an id outside the map is
only ever the target's own draw).

A map file is what SGLang loads: `torch.save` of a 1-D tensor or list of ids (`.pt`), or a JSON
list; `token_map.py` reads and writes one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def target_ids(d2t: Tensor) -> Tensor:
    """Target id of each draft id [N]."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def d2t_of(ids: Tensor) -> Tensor:
    """The d2t of a draft vocabulary's target ids, ascending: `target_ids`' inverse."""
    return ids - torch.arange(len(ids), device=ids.device)


def on_target_vocab(draft: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """Logits over the draft ids [.., N] placed on the target vocabulary [.., V], -inf at ids
    the draft cannot name: argmax is the mapped draft argmax, and any warp of them is the
    draft's warped distribution, zero elsewhere."""
    out = draft.new_full((*draft.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, target_ids(d2t), draft)


def mapped_argmax(draft: Tensor, d2t: Tensor) -> Tensor:
    """`on_target_vocab(draft, ..).argmax(-1)` without the target-wide logits. The same token,
    ties included: target ids ascend with draft ids, so the first maximum in draft order is the
    first in target order."""
    ids = draft.argmax(-1)
    return ids + d2t[ids]


def token_counts(texts: Iterable[Sequence[int]], vocab_size: int) -> Tensor:
    """How often each id [vocab_size] occurs over the token ids of `texts`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in texts:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def coverage(counts: Tensor, ids: Tensor) -> float:
    """The share of the counted tokens that `ids` hold."""
    return float(counts[ids].sum()) / max(int(counts.sum()), 1)


def frequency_map(counts: Tensor, size: int) -> Tensor:
    """The `size` most frequent ids of `counts` [V] (ties and unseen ids by id), ascending."""
    if not 1 <= size <= len(counts):
        raise ValueError(f"size must be in [1, {len(counts)}], got {size}")
    # A stable sort on -count keeps equal counts in id order.
    ranked = torch.sort(-counts.long(), stable=True).indices
    return ranked[:size].sort().values
