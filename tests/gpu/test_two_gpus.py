"""The draft service on a GPU of its own: `--device cuda:0` for the target and `cuda:1` for the
draft, as `specpair up --draft-device cuda:1` starts them. Every kernel of the draft (Triton,
flashinfer, graphs) runs on its GPU; speculation across the two stays the target's greedy
choice, with either service on either GPU, and a draft stopped (SIGSTOP) or killed mid-run
loses no request and changes no token."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip("flashinfer")

from bench.services import BenchServices, apply_tier
from specpair.client import SpecpairClient
from specpair.config import MODELS_DIR
from specpair.runtime.build import build_target
from tests.gpu.test_cuda_runtime import teacher_forced_logits, tie_tolerance
from tests.gpu.test_shipped_pair import TEXTS

pytestmark = pytest.mark.gpu
NEW_TOKENS = 48


def used_mib(device: int) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


def assert_greedy(gpu_target, prompt: list[int], out: list[int]) -> None:
    """Each emitted token is the GPU target's own greedy choice (up to a bf16 near-tie)."""
    logits = teacher_forced_logits(gpu_target, prompt, out)
    picked = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
    deficit = logits.max(-1).values - picked
    assert (deficit <= tie_tolerance(logits)).all(), f"{deficit.max()}"


# (the target's GPU, the draft's): either service on either GPU
PLACEMENTS = [(0, 1), (1, 0)]


@pytest.mark.parametrize(("on_gpu", "draft_gpu"), PLACEMENTS)
@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_a_draft_on_its_own_gpu_gives_the_targets_greedy_tokens(
    tmp_path: Path, kind: str, on_gpu: int, draft_gpu: int
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS_DIR / "target"))
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    gpu = build_target(
        MODELS_DIR / "target", max_requests=1, max_len=256, dtype=torch.bfloat16, device="cuda:0"
    )
    before = used_mib(draft_gpu)
    draft = MODELS_DIR / ("draft" if kind == "model" else kind)
    with BenchServices(
        target=MODELS_DIR / "target",
        draft=draft,
        log_dir=tmp_path,
        draft_kind="model" if kind == "model" else "eagle",
        device=f"cuda:{on_gpu}",
        draft_device=f"cuda:{draft_gpu}",
        dtype="bfloat16",
        max_len=256,
    ) as group:
        assert used_mib(draft_gpu) > before + 100, "the draft's weights and cache are elsewhere"
        client = SpecpairClient(group.target, timeout=120)
        accepted = 0
        for tier in (1, 7):
            apply_tier(group.target, tier)
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(
                    pool.map(lambda p: client.generate(p, max_tokens=NEW_TOKENS), prompts)
                )
            for prompt, result in zip(prompts, results, strict=True):
                assert len(result.token_ids) == NEW_TOKENS
                assert_greedy(gpu, prompt, list(result.token_ids))
                accepted += sum(max(a, 0) for a in result.accept_lengths)
    assert accepted > 0, "the draft was never accepted: speculation did not run"


def test_a_draft_stopped_then_killed_on_its_own_gpu_loses_nothing(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS_DIR / "target"))
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    gpu = build_target(
        MODELS_DIR / "target", max_requests=1, max_len=256, dtype=torch.bfloat16, device="cuda:0"
    )
    with BenchServices(
        target=MODELS_DIR / "target",
        draft=MODELS_DIR / "eagle3",
        log_dir=tmp_path,
        draft_kind="eagle",
        device="cuda:0",
        draft_device="cuda:1",
        dtype="bfloat16",
        max_len=256,
        target_options=("--draft-timeout", "1"),
    ) as group:
        client = SpecpairClient(group.target, timeout=120)
        apply_tier(group.target, 3)
        draft = group.procs["draft"]

        def chaos() -> None:
            time.sleep(0.3)
            draft.send_signal(signal.SIGSTOP)  # healthy to the kernel, silent to the target
            time.sleep(2.5)
            draft.send_signal(signal.SIGCONT)
            time.sleep(0.5)
            draft.kill()

        thread = threading.Thread(target=chaos)
        thread.start()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=160), prompts * 2))
        thread.join()
    for prompt, result in zip(prompts * 2, results, strict=True):
        assert len(result.token_ids) == 160
        assert_greedy(gpu, prompt, list(result.token_ids))
