"""The CUDA path: flashinfer paged tree attention, fused layers, per-tier CUDA graphs (bf16).

Run on the device machine (`pytest -m gpu tests/gpu`); skipped cleanly without CUDA/flashinfer.
Models use head_dim 128 (flashinfer's kernels cover 64/128/256, not the CPU tests' 16).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from transformers import LlamaForCausalLM

from specpair.models.tiny import make_tiny_eagle, make_tiny_llama
from specpair.runtime import cuda_graphs, state
from specpair.runtime.build import build_drafter, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.kv_cache import BatchLayout

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
PROMPTS = [[5, 6, 7], list(range(10, 60)), [3], [100, 200, 50, 60, 70, 80, 90]]


@pytest.fixture(scope="module")
def gpu_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_ckpts")
    shape = dict(hidden_size=256, num_heads=2, num_kv_heads=1, intermediate_size=512)
    target = make_tiny_llama(root / "target", seed=1, num_layers=2, **shape)  # type: ignore[arg-type]
    return {
        "target": target,
        "draft": make_tiny_llama(root / "draft", seed=2, num_layers=1, **shape),  # type: ignore[arg-type]
        "eagle": make_tiny_eagle(root / "eagle", target, seed=3),
    }


def target(path: Path, max_requests: int = 4):
    gc.collect()  # workers of earlier tests must not capture into this test's states
    return build_target(
        path, max_requests=max_requests, max_len=256, keep_features=True, dtype=BF16, device="cuda"
    )


def test_logits_match_transformers(gpu_ckpts: dict[str, Path]) -> None:
    hf = LlamaForCausalLM.from_pretrained(gpu_ckpts["target"], dtype=BF16).cuda().eval()
    worker = target(gpu_ckpts["target"])
    tokens = torch.tensor([list(range(3, 43)), list(range(50, 90))], device="cuda")
    with torch.inference_mode():
        ref = hf(tokens).logits.float()
        slots = [worker.cache.alloc(), worker.cache.alloc()]
        layout = BatchLayout.causal(slots, [0, 0], [40, 40])
        positions = torch.arange(40, device="cuda").expand(2, 40)
        ours = worker.model.logits(worker.model(tokens, positions, worker.cache.bind(layout)))
    err = (ours - ref).norm() / ref.norm()
    assert err < 2e-2, f"relative error {err:.3g}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.97


@pytest.mark.parametrize("draft", ["draft", "eagle"])
def test_greedy_speculative_equals_gpu_target_only(gpu_ckpts: dict[str, Path], draft: str) -> None:
    worker = target(gpu_ckpts["target"])
    drafter = build_drafter(
        gpu_ckpts[draft],
        target_path=gpu_ckpts["target"],
        max_requests=4,
        max_len=256,
        dtype=BF16,
        device="cuda",
    )
    states = state.build_states([1, 3, 7])  # captures verify/extend/draft graphs per tier
    plain = SpeculativeEngine(worker, None).generate(PROMPTS, max_new_tokens=32, state=None)
    before = cuda_graphs.captures(), state.builds()
    for tier in (3, 1, 7, 3):  # tier switches: reference swaps only
        spec = SpeculativeEngine(worker, drafter).generate(
            PROMPTS, max_new_tokens=32, state=states[tier]
        )
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], f"tier {tier}"
    assert (cuda_graphs.captures(), state.builds()) == before, "captured/built after start-up"


def test_graph_replay_equals_eager(gpu_ckpts: dict[str, Path]) -> None:
    worker = target(gpu_ckpts["target"])
    states = state.build_states([3])
    seqs_tokens = torch.randint(0, 320, (3, 4))
    out = []
    for st in (states[3], None):  # graph (bucket 4, padded) vs eager flashinfer
        slots = [worker.cache.alloc() for _ in range(3)]
        mask = torch.ones(4, 4, dtype=torch.bool).tril().expand(3, 4, 4)
        layout = BatchLayout(torch.tensor(slots), torch.tensor([0, 5, 9]), mask)
        positions = layout.starts[:, None] + torch.arange(4)
        with torch.inference_mode():
            hidden, logits = worker._forward_tree(seqs_tokens, positions, layout, st)
        out.append((hidden.clone(), logits.clone()))
        for s in slots:
            worker.cache.free(s)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-2, atol=1e-2)
    assert torch.equal(out[0][1].argmax(-1), out[1][1].argmax(-1))
