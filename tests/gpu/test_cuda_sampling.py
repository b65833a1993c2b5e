"""Sampled decoding on the GPU: warps, draws and rejection on the device, in the step graphs.

The distribution test of `tests/engine/test_sampling_lossless.py` on the CUDA runtime (bf16,
flashinfer attention, per-tier graphs, the sampled twin of each draft step graph): the joint
distribution of 3 sampled tokens of a 6-token vocabulary against the target's exact one, for
every warp and tiers 1 / 3 / 7, with sparse q, and a broken residual that must fail; tree
shapes by SGLang's target-only rule, and a verifier accepting every first child that must
fail. Then the seeded-sampling promise: a seed gives the same tokens run after run, and a
row's draw does not depend on the rows beside it.
"""

from __future__ import annotations

import gc
import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from transformers import LlamaForCausalLM

import specpair.runtime.accept as accept_module
import specpair.runtime.sampling as sampling_module
from specpair.models.draft_vocab import d2t_of, on_target_vocab
from specpair.models.tiny import make_tiny_eagle, make_tiny_eagle3, make_tiny_llama
from specpair.runtime.accept_batch import accept_candidates
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.gpu.capture import GraphCapture
from specpair.runtime.gpu.draft_sampling import draft_support as one_kernel_support
from specpair.runtime.gpu.draw_graphs import DrawGraphs
from specpair.runtime.gpu.step_graphs import StepGraphs
from specpair.runtime.gpu.tree_graphs import TreeGraphs
from specpair.runtime.gpu.verify_graphs import VOCABULARY_ACCEPT_BATCH, VerifyGraphs
from specpair.runtime.sampling import (
    RowParams,
    SamplingParams,
    draft_support,
    sample_rows,
    warp,
    warp_rows,
)
from specpair.runtime.shape import TreeShape
from tests.engine.test_sampling_lossless import PARAMS, fit_pvalue

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
VOCAB, PROMPT, DEPTH, RUNS = 6, [1, 4, 2], 3, 4096
SHAPE = dict(hidden_size=256, num_heads=2, num_kv_heads=1, intermediate_size=512)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_small_vocab")
    common = {"vocab_size": VOCAB, "tokenizer": False, "init_std": 0.3, **SHAPE}
    target = make_tiny_llama(root / "target", seed=21, num_layers=2, **common)  # type: ignore[arg-type]
    return {
        "target": target,
        "draft": make_tiny_llama(root / "draft", seed=22, num_layers=1, **common),  # type: ignore[arg-type]
        "eagle": make_tiny_eagle(root / "eagle", target, seed=23),
        # an EAGLE-3 head naming 4 of the 6 tokens: its q is zero at the other two
        "eagle3": make_tiny_eagle3(
            root / "eagle3", target, seed=24, draft_vocab=4, layers=[0, 0, 0]
        ),
        # a token map naming 3 of the 6 tokens for the EAGLE-1 head (`draft_vocab.py`)
        "map": _token_map(root / "map.json", [0, 2, 5]),
    }


def _token_map(path: Path, ids: list[int]) -> Path:
    path.write_text(json.dumps(ids))
    return path


def exact_joint(target: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's own joint distribution of the 3 tokens, from transformers in bf16 on the
    GPU (the served model's numerics, to bf16 rounding)."""
    model = LlamaForCausalLM.from_pretrained(target, dtype=BF16).cuda().eval()
    outcomes = list(itertools.product(range(VOCAB), repeat=DEPTH))
    ids = torch.tensor([PROMPT + list(o) for o in outcomes], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1 : -1].float().cpu()
    picked = warp(logits, params).gather(-1, ids[:, len(PROMPT) :, None].cpu())[..., 0]
    return {o: float(p) for o, p in zip(outcomes, picked.prod(-1), strict=True)}


def gpu_samples(
    ckpts: dict[str, Path],
    draft: str,
    params: SamplingParams,
    tier: int | TreeShape,
    batch: int = 16,
    token_map: Path | None = None,
) -> Counter:
    """RUNS seeded samples in batches of `batch`: a chain's accept runs in its graph (over
    the vocabulary, unfiltered rows: up to 16, past it eagerly); a tree shape verifies in its
    graphs and accepts eagerly."""
    gc.collect()
    target = ckpts["target"]
    worker = build_target(
        target,
        max_requests=batch,
        max_len=64,
        keep_features=True,
        dtype=BF16,
        device="cuda",
        feature_layers=feature_layers(ckpts[draft], target),
    )
    drafter = build_drafter(
        ckpts[draft],
        target_path=target,
        max_requests=batch,
        max_len=64,
        dtype=BF16,
        device="cuda",
        token_map=token_map,
    )
    state = build_states([tier], worker, drafter)[tier]
    chain = state.is_chain
    assert not chain or (isinstance(state.draft, StepGraphs) and state.draft.sampled)
    engine = SpeculativeEngine(worker, drafter)
    counts: Counter = Counter()
    for start in range(0, RUNS, batch):
        sampling = [
            SamplingParams(params.temperature, params.top_p, params.top_k, start + i, params.min_p)
            for i in range(batch)
        ]
        results = engine.generate(
            [PROMPT] * batch, max_new_tokens=DEPTH, state=state, sampling=sampling
        )
        counts.update(tuple(r.token_ids) for r in results)
    assert isinstance(state.verify, VerifyGraphs)
    if not chain:
        assert isinstance(state.draft, TreeGraphs) and state.draft.replays > 0
    else:
        assert isinstance(state.draft, StepGraphs)
        assert state.draft.sampled_replays > 0  # the sampled graph drew the drafts
        filtered = params.top_p < 1 or params.top_k > 0 or params.min_p > 0
        assert (state.verify.graph_accepts > 0) == (filtered or batch <= VOCABULARY_ACCEPT_BATCH)
    return counts


@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.8-k4-p0.9", "t0.7-p0.95-minp0.05"])
@pytest.mark.parametrize("tier", [1, 3, 7])
def test_gpu_sampling_matches_target_distribution(small_vocab, params, tier) -> None:
    counts = gpu_samples(small_vocab, "eagle", params, tier)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], params)) > 1e-3


@pytest.mark.parametrize("params", PARAMS[::2], ids=["t1.0", "t0.7-p0.95-minp0.05"])
def test_gpu_eagle3_sampling_matches_target_distribution(small_vocab, params) -> None:
    """The fused EAGLE-3 head in its sampled graphs, q on the target's ids (zero off the draft
    vocabulary), the target's verify graphs sending three layers' features."""
    counts = gpu_samples(small_vocab, "eagle3", params, 3)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], params)) > 1e-3


@pytest.mark.parametrize("tier", [3, TreeShape(3, 2, 4)], ids=str)
def test_gpu_mapped_eagle_sampling_matches_target_distribution(small_vocab, tier) -> None:
    """The fused EAGLE-1 head given a token map: its LM head holds 3 of the 6 rows, its q (a
    chain's, in the sampled graphs) or its tree's candidates lie on the mapped ids only."""
    counts = gpu_samples(small_vocab, "eagle", PARAMS[2], tier, token_map=small_vocab["map"])
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[2])) > 1e-3


def test_gpu_sparse_q_of_a_draft_lm_matches_target_distribution(small_vocab, monkeypatch) -> None:
    monkeypatch.setattr(sampling_module, "DRAFT_SUPPORT", 2)  # read when the graphs capture
    counts = gpu_samples(small_vocab, "draft", PARAMS[0], 3, batch=64)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[0])) > 1e-3


TREES = [TreeShape(3, 2, 4), TreeShape(3, 3, 9)]


@pytest.mark.parametrize("shape", TREES, ids=str)
@pytest.mark.parametrize("draft", ["draft", "eagle"])
def test_gpu_sampled_trees_match_target_distribution(small_vocab, draft, shape) -> None:
    """Trees drafted in their graphs, verified in the shape's graphs by SGLang's target-only
    rule (`accept.accept_trees`)."""
    counts = gpu_samples(small_vocab, draft, PARAMS[2], shape)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[2])) > 1e-3


def test_gpu_trees_accepting_every_first_child_fail_the_same_test(small_vocab, monkeypatch):
    real = accept_module.accept_trees

    def first_child(p, tokens, parents, u):  # type: ignore[no-untyped-def]
        u = u.clone()
        u[:, 1:] = 0.0  # accepts any child with mass; the last token drawn as before
        return real(p, tokens, parents, u)

    monkeypatch.setattr(accept_module, "accept_trees", first_child)
    counts = gpu_samples(small_vocab, "eagle", PARAMS[0], TREES[0])
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[0])) < 1e-6


def test_gpu_sampling_in_the_accept_graph_of_64_matches_target_distribution(small_vocab) -> None:
    """Filtered rows at batch 64: their accept replays the candidates' graph of that bucket."""
    counts = gpu_samples(small_vocab, "draft", PARAMS[2], 3, batch=64)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[2])) > 1e-3


@pytest.mark.parametrize(
    ("params", "batch"), [(0, 16), (0, 64), (2, 64)], ids=["graph", "eager", "graph-64"]
)
def test_gpu_broken_residual_fails_the_same_test(small_vocab, monkeypatch, params, batch) -> None:
    """In the accept graphs (captured with the broken rule: over the vocabulary at 16, over
    candidates at 64) and eagerly (unfiltered at 64)."""
    monkeypatch.setattr(accept_module, "residual", lambda p, q: p)
    counts = gpu_samples(small_vocab, "draft", PARAMS[params], 3, batch)
    assert fit_pvalue(counts, exact_joint(small_vocab["target"], PARAMS[params])) < 1e-6


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_seeded")
    target = make_tiny_llama(root / "target", seed=1, num_layers=2, **SHAPE)  # type: ignore[arg-type]
    return {"target": target, "eagle": make_tiny_eagle(root / "eagle", target, seed=3)}


@pytest.mark.parametrize("tier", [0, 3])
def test_a_seed_gives_the_same_tokens_run_after_run(wide, tier: int) -> None:
    """Target alone (tier 0) and speculative: the same seeds, the same batch → the same tokens
    (the draws come from the requests' own generators, and nothing else is random)."""
    gc.collect()
    worker = build_target(
        wide["target"], max_requests=8, max_len=128, keep_features=True, dtype=BF16, device="cuda"
    )
    drafter = build_drafter(
        wide["eagle"],
        target_path=wide["target"],
        max_requests=8,
        max_len=128,
        dtype=BF16,
        device="cuda",
    )
    state = build_states([max(tier, 1)], worker, drafter)[max(tier, 1)]
    engine = SpeculativeEngine(worker, drafter if tier else None)
    prompts = [[5 + i, 6, 7 + 2 * i, 100 - i] for i in range(8)]
    sampling = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(8)]

    def run() -> list[list[int]]:
        results = engine.generate(prompts, max_new_tokens=24, state=state, sampling=sampling)
        return [r.token_ids for r in results]

    first = run()
    assert run() == first
    assert len({tuple(t) for t in first}) > 1  # the seeds made different samples


@pytest.mark.parametrize("rows", [4, 8])
def test_a_rows_draw_does_not_depend_on_the_batch_around_it(rows: int) -> None:
    """The sampler's part of the seeded promise, on the device: a row warped, drawn and drafted
    alone gives bitwise what it gives among 7 other rows of other parameters. (End to end a
    request's logits themselves change with the batch in bf16: the GEMMs and attention reduce
    in a batch-dependent order, which the batch-invariant mode is for.)"""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(8, 128256, device="cuda", generator=gen) * 4
    u = torch.rand(8, device="cuda", generator=gen)
    params = [
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=100),
        SamplingParams(temperature=2.0, top_p=0.99),  # a cut past the candidates: sorts
        SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05),
    ][:rows]
    table = RowParams.of(params).to(torch.device("cuda"))
    together = sample_rows(warp_rows(logits[:rows], table), u[:rows])
    drafted = draft_support(logits[:rows], table, u[:rows])
    for i, p in enumerate(params):
        alone = RowParams.of([p]).to(torch.device("cuda"))
        assert int(sample_rows(warp_rows(logits[i : i + 1], alone), u[i : i + 1])) == together[i]
        one = draft_support(logits[i : i + 1], alone, u[i : i + 1])
        assert all(torch.equal(a[0], b[i]) for a, b in zip(one, drafted, strict=True))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_draw_graph_draws_as_the_eager_warp_and_draw(tmp_path: Path, rows: int) -> None:
    """Rows of a Llama-3 vocabulary, greedy, T 0.7 top-p 0.95, T 1 unfiltered and top-k 5
    with min-p mixed: the draw graph of their bucket gives each row the token `warp_rows` and
    `sample_rows` give it from the same uniform; a flat row, whose top-p cut lies past its
    1024 candidates, sends the batch back to the eager draw (None)."""
    v, dev = 128256, torch.device("cuda")
    worker = build_target(
        make_tiny_llama(tmp_path / "t", seed=1, **SHAPE), max_requests=8, max_len=32, device="cuda"
    )
    draws = DrawGraphs(GraphCapture(worker.cache, 8, "target"), v)
    gen = torch.Generator(device=dev).manual_seed(rows)
    logits = torch.randn(rows, v, device=dev, generator=gen) * 4
    logits[:, :32] += 24
    mix = [
        SamplingParams(),
        SamplingParams(0.7, top_p=0.95),
        SamplingParams(1.0),
        SamplingParams(0.8, top_k=5, min_p=0.1),
    ]
    params = RowParams.of([mix[i % len(mix)] for i in range(rows)])
    u = torch.rand(rows, generator=torch.Generator().manual_seed(rows))
    eager = sample_rows(warp_rows(logits, params.to(dev)), u.to(dev)).tolist()
    assert draws.run(logits, params, u) == eager
    flat = torch.zeros(1, v, device=dev)
    assert draws.run(flat, RowParams.of([SamplingParams(1.0, top_p=0.5)]), u[:1]) is None
    assert draws.replays == 2


@pytest.mark.parametrize("batch", [1, 8])
def test_the_candidates_accept_in_a_graph_gives_the_vocabulary_wide_verdicts(batch: int) -> None:
    """On a Llama-3 vocabulary, tier-7 chains with a 64-token q: `accept_candidates` replayed
    in a CUDA graph (its topk in two levels) accepts as many drafts as `accept_chains` over
    the whole vocabulary for the same uniforms, and draws its last tokens where p has mass."""
    v, n, dev = 128256, 7, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch)
    logits = torch.randn(batch, n + 1, v, device=dev, generator=gen) * 4
    logits[..., :32] += 24  # T 0.7, top-p 0.95 keeps several of these 32
    drafts = logits[:, :n].argmax(-1)
    drafts[:, n // 2 :] = torch.randint(0, 32, (batch, n - n // 2), device=dev, generator=gen)
    q_ids = torch.randint(0, v, (batch, n, 64), device=dev, generator=gen)
    q_ids[..., 0] = drafts
    q = torch.softmax(torch.randn(batch, n, 64, device=dev, generator=gen), -1)
    lengths = torch.full((batch,), n, device=dev)
    u = torch.rand(batch, n + 1, device=dev, generator=gen)
    params = RowParams.of([SamplingParams(temperature=0.7, top_p=0.95)] * batch).repeat(n + 1)
    params = params.to(dev)
    args = (logits, params, drafts, lengths, u, q_ids, q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    accept_candidates(*args)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        out = accept_candidates(*args)
    graph.replay()
    accepted, last, covered = (t.cpu() for t in out)
    p = warp_rows(logits.view(-1, v), params).view(batch, n + 1, v)
    dense_q = torch.zeros(batch, n, v, device=dev).scatter_add_(-1, q_ids, q)
    reference, _ = accept_module.accept_chains(p, dense_q, drafts, lengths, u)
    assert covered.all()
    assert accepted.tolist() == reference.tolist()
    assert (p[torch.arange(batch), accepted.to(dev), last.to(dev)] > 0).all()


FUSED_PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(),  # greedy: the likeliest
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0),
]


@pytest.mark.parametrize("vocab", [4, 6, 300, 32_000])
def test_the_one_kernel_draft_step_draws_as_the_torch_one(vocab: int) -> None:
    """`gpu.draft_sampling.draft_support` against `sampling.draft_support`, row by row: the
    same support, q to float rounding, the same token from the same uniform (a uniform within
    rounding of a cumulative mass may land either side: allowed for at most 1 row in 500)."""
    from specpair.runtime.gpu.draft_sampling import draft_support as one_kernel

    rows = 3000
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
    params = RowParams.of([FUSED_PARAMS[i % len(FUSED_PARAMS)] for i in range(rows)]).to(
        torch.device("cuda")
    )
    u = torch.rand(rows, device="cuda", generator=gen)
    names = torch.arange(vocab, device="cuda") * 3 + 1  # a draft vocabulary's target ids
    tokens, ids, q = one_kernel(logits, params, u, names=names)
    ref_tokens, ref_ids, ref_q = draft_support(logits, params, u, names=names)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-4)
    assert torch.allclose(q.sum(-1), torch.ones(rows, device="cuda"))
    assert int((tokens != ref_tokens).sum()) <= rows // 500
    greedy = params.greedy
    assert torch.equal(tokens[greedy], ids[greedy, 0])


def test_the_one_kernel_draft_step_draws_from_the_q_it_returns() -> None:
    """30 000 draws of one row: their counts fit the q returned (chi-square), and none falls
    where q has no mass; a draw from q's first column alone (a wrong kernel) fails the same."""
    from specpair.runtime.gpu.draft_sampling import draft_support as one_kernel

    rows = 30_000
    logits = (torch.randn(1, 100, generator=torch.Generator().manual_seed(5)) * 3).expand(rows, -1)
    logits = logits.contiguous().cuda()
    params = RowParams.of([SamplingParams(temperature=0.8, top_p=0.9)] * rows).to(
        torch.device("cuda")
    )
    u = torch.rand(rows, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    tokens, ids, q = one_kernel(logits, params, u, width=8)
    dense = torch.zeros(100).scatter_(0, ids[0].cpu(), q[0].cpu())
    counts = torch.bincount(tokens.cpu(), minlength=100)
    assert counts[dense == 0].sum() == 0
    kept = dense[dense > 0].double()
    observed, expected = counts[dense > 0].double(), kept / kept.sum() * rows
    from scipy.stats import chisquare

    assert chisquare(observed.tolist(), expected.tolist()).pvalue > 1e-3
    wrong = torch.bincount(ids[:, 0].cpu(), minlength=100)[dense > 0].double()
    assert chisquare(wrong.tolist(), expected.tolist()).pvalue < 1e-6


@pytest.mark.parametrize("kernel", [draft_support, one_kernel_support])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_draft_vocabulary_placed_on_the_targets_draws_alike_in_a_graph(
    rows: int, kernel: Callable[..., tuple[torch.Tensor, ...]]
) -> None:
    """An EAGLE-3 head's logits over a Llama-3 vocabulary (`Eagle3Head.logits`, as its tree
    graphs read them: 32 000 draft ids placed among 128 256 by an ascending id map) then the
    draft's draw, captured in a CUDA graph at 1, 8 and 64 rows and replayed: the eager result.
    (A kernel benchmark once tripped `index_copy_`'s bounds assert here at 8 rows.)"""
    v, n, dev = 128256, 32000, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows)
    ids = torch.randperm(v, device=dev, generator=gen)[:n].sort().values  # the draft's target ids
    d2t = d2t_of(ids)
    logits = torch.randn(rows, n, device=dev, generator=gen) * 4
    u = torch.rand(rows, device=dev, generator=gen)
    table = RowParams.of([SamplingParams(temperature=0.7, top_p=0.95)] * rows).to(dev)

    def step() -> tuple[torch.Tensor, ...]:
        return kernel(on_target_vocab(logits, d2t, v), table, u)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    logits.copy_(torch.randn(rows, n, device=dev, generator=gen) * 4)
    graph.replay()
    torch.cuda.synchronize()
    again = step()
    assert all(torch.equal(a, b) for a, b in zip(captured, again, strict=True))
    assert not torch.equal(captured[0], eager[0]) or rows == 1  # the replay read the new logits
    assert bool((ids[..., None] == captured[0][None]).any(0).all())  # drawn among the draft's ids
