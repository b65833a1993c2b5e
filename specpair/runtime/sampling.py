"""Sampling parameters and the logits → probabilities warp shared by draft and target.

Two forms of the same rules: `warp` and `sample` work on one request on the host (the
reference the tests hold the batched code to); `RowParams`, `warp_rows`, `sample_rows` and
`draft_support` work on a batch of rows on whatever device holds the logits, with no host
round trip, inside CUDA graphs too. Randomness enters the batched form as one uniform per
draw, drawn on the host from the request's own generator, so a seeded request draws the same
numbers at batch 1 and inside any batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# A temperature divides the logits: below ~1e-3 float32 logits overflow to inf (1e-45 makes
# every row NaN after softmax), and past 100 the distribution is uniform to within 1e-2 for
# logits spanning a few units, so neither end buys the client anything.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
SEED_LIMIT = 2**64  # seeds are uint64 on the wire and in torch.Generator.manual_seed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → whole vocabulary
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p × the likeliest one's probability

    def __post_init__(self) -> None:
        t = self.temperature
        if not (t == 0.0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {t}"
            )
        # NaN fails every comparison, so the range check below refuses it too.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [..., V] after temperature, top-k, top-p (nucleus) and min-p filtering,
    in that order (SGLang's): min-p is relative to the likeliest token left.

    Draft and target use the same warp, so rejection sampling recovers exactly the
    distribution that plain sampling with these parameters would produce.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def derived_seed(seed: int | None, salt: int) -> int | None:
    """A second seed from `seed`, still a valid uint64: 2**64 - 1 with salt 1 wraps to 0."""
    return None if seed is None else (seed + salt) % SEED_LIMIT


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


# The tokens of a sampled draft's q: 7 nodes × 64 × (id, prob) = 3.6 KB a tier-7 tree.
DRAFT_SUPPORT = 64
# The target's warp seeks its cut among each row's CANDIDATES likeliest tokens; one row past
# them sends the batch's accept out of its graph (256: a third of batch-8 tier-7 rounds, H100).
CANDIDATES = 1024


@dataclass(frozen=True, slots=True)
class RowParams:
    """The sampling parameters of a batch's rows as one float32 table [R, 5] on the rows' device,
    columns (temperature, top_k, top_p, min_p, greedy): one copy into a graph's static buffer.
    A greedy row holds temperature 1 so that the warp stays finite; `greedy` overrides it."""

    table: Tensor
    filters: bool = True  # some row has top-k, top-p or min-p
    any_plain: bool = True  # some sampled row has none of them (its warp is a softmax)
    any_greedy: bool = True  # some row is greedy (else the warp needs no one-hot rows)

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> RowParams:
        """The host table of `params` (top_k exact in float32 below 2**24)."""
        rows = [
            (p.temperature or 1.0, float(p.top_k), p.top_p, p.min_p, float(p.greedy))
            for p in params
        ]
        filtered = [bool(p.top_k or p.top_p < 1.0 or p.min_p > 0.0) for p in params]
        table = torch.tensor(rows, dtype=torch.float32).view(-1, 5)
        plain = any(not f and not p.greedy for f, p in zip(filtered, params, strict=True))
        return RowParams(table, any(filtered), plain, any(p.greedy for p in params))

    def _with(self, table: Tensor) -> RowParams:
        return RowParams(table, self.filters, self.any_plain, self.any_greedy)

    def to(self, device: torch.device) -> RowParams:
        return self._with(self.table.to(device, non_blocking=True))

    def rows(self, index: Tensor | list[int]) -> RowParams:
        return self._with(self.table[index])

    def repeat(self, n: int) -> RowParams:
        """Each row n times in a row: [B] requests → [B * n] tree rows."""
        return self._with(self.table.repeat_interleave(n, 0))

    @property
    def temperature(self) -> Tensor:
        return self.table[:, 0:1]  # [R, 1]

    def top_k(self, width: int) -> Tensor:
        """[R, 1] long: each row's k, `width` where it keeps every token (0 or k > width)."""
        k = self.table[:, 1:2].long()
        return torch.where((k > 0) & (k < width), k, width)

    @property
    def top_p(self) -> Tensor:
        return self.table[:, 2:3]

    @property
    def min_p(self) -> Tensor:
        return self.table[:, 3:4]

    @property
    def greedy(self) -> Tensor:
        return self.table[:, 4] > 0  # [R] bool

    @property
    def plain(self) -> Tensor:
        """[R] bool: rows without top-k, top-p or min-p."""
        return (self.table[:, 1] == 0) & (self.table[:, 2] >= 1.0) & (self.table[:, 3] <= 0.0)


def warp_rows(logits: Tensor, params: RowParams) -> Tensor:
    """`warp` for a batch of rows [R, V] with per-row parameters, on the rows' device: float32
    probabilities [R, V]; a greedy row is one-hot at its argmax. Each filter keeps a prefix of
    the row sorted by logit, so together they keep the tokens at or above one threshold, looked
    for among the row's `CANDIDATES` likeliest tokens; only a row whose cut lies past them sorts
    its whole row (`_sorted_warp`; one host sync decides). A row's way depends on that row
    alone, so its probabilities are the same bits whatever batch it is in."""
    probs, covered = warp_candidates(logits, params)
    if covered is not None and not bool(covered.all()):
        rows = (~covered).nonzero()[:, 0]
        x = logits[rows].float() / params.rows(rows).temperature
        probs[rows] = _sorted_warp(x, params.rows(rows))
    return probs


def warp_candidates(logits: Tensor, params: RowParams) -> tuple[Tensor, Tensor | None]:
    """`warp_rows` without its sorts, graph-safe: the probabilities [R, V], and which rows
    they hold for ([R] bool; None when no row filters). A row whose cut lies past its
    candidates needs `warp_rows`. The host flags of `params` skip what no row needs."""
    x = logits.float() / params.temperature
    probs = torch.softmax(x, -1) if params.any_plain or not params.filters else None
    covered = None
    if params.filters:
        plain = params.plain
        ids, kept, covered = candidate_probs(x, params)
        filtered = torch.zeros_like(x).scatter_(-1, ids, kept)
        covered |= plain | params.greedy  # a greedy row is one-hot below
        probs = filtered if probs is None else torch.where(plain[:, None], probs, filtered)
    assert probs is not None
    if params.any_greedy:
        hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(params.greedy[:, None], hot, probs)
    return probs, covered


def candidate_probs(x: Tensor, params: RowParams) -> tuple[Tensor, Tensor, Tensor]:
    """The warp of temperature-scaled logits x [R, V] over each row's c = min(CANDIDATES, V)
    likeliest tokens: (ids [R, c], probabilities [R, c], descending, 0 past the cut; covered
    [R]: the cut and every token tied at it lie among them, so they hold all the mass).
    For rows with top-k, top-p or min-p (an unfiltered row's cut is the whole vocabulary)."""
    v = x.shape[-1]
    c = min(CANDIDATES, v)
    top, ids = x.topk(c, dim=-1)  # descending
    k = params.top_k(v)  # [R, 1]; v keeps every token
    kth = top.gather(-1, k.clamp(max=c) - 1)
    in_k = (top >= kth) | (k >= v)
    # top-p counts mass on the top-k distribution: normalised over the k kept (or all v)
    full = x.logsumexp(-1, keepdim=True)
    lse = torch.where(k >= v, full, top.masked_fill(~in_k, float("-inf")).logsumexp(-1, True))
    p = (top - lse).exp() * in_k
    keep = in_k & (((p.cumsum(-1) - p) < params.top_p) | (params.top_p >= 1.0))
    keep &= p >= params.min_p * p[:, :1]
    n = keep.sum(-1, keepdim=True)  # a prefix: the row's kept count
    threshold = top.gather(-1, n - 1)
    # ties with the cut (or with a top-k's k-th token, which the normaliser counts) may go
    # on past the last candidate: only a last candidate below them proves they do not
    last = top[:, -1:]
    covered = (c == v) | torch.where(k >= v, last < threshold, last < kth)
    probs = (top - top[:, :1]).exp().masked_fill(top < threshold, 0.0)
    return ids, probs / probs.sum(-1, keepdim=True), covered[:, 0]


def _sorted_warp(x: Tensor, params: RowParams) -> Tensor:
    """The warp of x [R, V] by one stable sort of each whole row (ties to the lower id)."""
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kth = xs.gather(-1, params.top_k(x.shape[-1]) - 1)  # ties with the k-th stay, as in `warp`
    ps = torch.softmax(xs.masked_fill(xs < kth, float("-inf")), -1)
    # top-p keeps the smallest prefix whose mass reaches it; top_p = 1 keeps all (a float
    # cumsum can pass 1 before the tail)
    drop = ((ps.cumsum(-1) - ps) >= params.top_p) & (params.top_p < 1.0)
    ps = ps.masked_fill(drop, 0.0)
    ps = ps.masked_fill(ps < params.min_p * ps[:, :1], 0.0)  # min-p of the kept max
    ps = ps / ps.sum(-1, keepdim=True)
    return torch.zeros_like(ps).scatter_(-1, order, ps)


def sample_rows(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row of probs [R, V] (rows summing to about 1) from uniforms u [R] in
    [0, 1), by the inverse CDF: the first token whose cumulative mass passes u × the row's.
    probs [0, .5, 0, .5], u .7 → cdf [0, .5, .5, 1] → token 3.

    A scan of a whole row runs on one SM; past 2 × DRAW_SLICE tokens the draw goes in two
    levels instead: a slice of DRAW_SLICE tokens by the slices' masses, then a token within
    it (the same inverse CDF: u × total less the mass before the slice, within the slice)."""
    r, v = probs.shape
    if v <= 2 * DRAW_SLICE:
        return _inverse_cdf(probs, u.to(probs.dtype) * probs.sum(-1))
    n = -(-v // DRAW_SLICE)
    blocks = torch.nn.functional.pad(probs, (0, n * DRAW_SLICE - v)).view(r, n, DRAW_SLICE)
    mass = blocks.sum(-1)  # [R, n]
    x = u.to(mass.dtype) * mass.sum(-1)
    block = _inverse_cdf(mass, x)  # [R]
    before = (mass.cumsum(-1) - mass).gather(-1, block[:, None])[:, 0]
    inner = blocks[torch.arange(r, device=probs.device), block]  # [R, DRAW_SLICE]
    return block * DRAW_SLICE + _inverse_cdf(inner, (x - before).clamp_min(0.0))


DRAW_SLICE = 1024


def _inverse_cdf(probs: Tensor, x: Tensor) -> Tensor:
    """Per row of probs [R, N] the first index whose cumulative mass passes x [R]. Never one
    of zero mass: past the row's total (rounding) it is the row's last index with mass."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, x[:, None].contiguous(), right=True)[:, 0]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return torch.minimum(idx, last)


def draft_candidates(x: Tensor, width: int | None, names: Tensor | None) -> tuple[Tensor, Tensor]:
    """A draft step's candidates: the K = min(width or `DRAFT_SUPPORT`, N) largest of x [R, N],
    descending, and their ids (`names`' [N] where given, else the columns)."""
    top, ids = x.topk(min(width or DRAFT_SUPPORT, x.shape[-1]), dim=-1)
    return top, ids if names is None else names[ids]


def draft_support(
    logits: Tensor,
    params: RowParams,
    u: Tensor,
    width: int | None = None,
    names: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A draft step's sampled token from a q of at most `width` tokens: (tokens [R], ids
    [R, K], q [R, K]), K = min(width, N). q is the temperature-warped distribution restricted
    to its K likeliest tokens (top-p counted over the whole vocabulary), cut by the row's
    top-k, top-p and min-p and renormalised: the exact distribution the token was drawn from,
    which is all rejection sampling needs of q. Greedy rows take the argmax. Graph-safe.
    `width` defaults to `DRAFT_SUPPORT`. logits [R, N] are over the ids `names` [N] (a draft
    vocabulary's target ids; None: column i is id i): a draft's logits over the ids it names
    are its logits on the whole vocabulary less the -inf elsewhere, which no warp keeps."""
    x = logits.float() / params.temperature
    top, ids = draft_candidates(x, width, names)
    k = top.shape[-1]
    p = (top - x.logsumexp(-1, keepdim=True)).exp()
    keep = torch.arange(k, device=x.device) < params.top_k(k)
    keep &= (p.cumsum(-1) - p) < params.top_p
    keep &= p >= params.min_p * p[:, :1]
    q = p * keep
    q = q / q.sum(-1, keepdim=True)
    tokens = ids.gather(-1, sample_rows(q, u)[:, None])[:, 0]
    return torch.where(params.greedy, ids[:, 0], tokens), ids, q  # greedy: the likeliest
