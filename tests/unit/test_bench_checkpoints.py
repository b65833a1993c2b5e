"""bench/checkpoints.py: random Llama-3-shaped checkpoints load through specpair and decode."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from bench.checkpoints import random_pair
from bench.gpu_common import LLAMA3_8B
from specpair.models.loading import read_args, read_tensors
from specpair.models.saving import EAGLE_SHARED, hf_config
from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.engine import SpeculativeEngine

# The Llama-3-8B code path (llama3 rope, GQA, untied head) at hidden 64.
SMALL = replace(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_llama3_8b_config_reads_back_as_the_8b_shape(tmp_path: Path) -> None:
    config = hf_config(LLAMA3_8B, torch.bfloat16, "LlamaForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_args(tmp_path) == LLAMA3_8B


def test_random_pair_is_sharded_bf16_and_reused(tmp_path: Path) -> None:
    target, eagle = random_pair(tmp_path, SMALL, shard_bytes=64 * 1024)
    assert len(list(target.glob("*.safetensors"))) > 1
    assert read_args(target) == SMALL
    assert read_args(eagle, allow_eagle=True) == replace(SMALL, num_layers=1)
    tensors = read_tensors(target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert bool((tensors["model.layers.1.post_attention_layernorm.weight"] == 1).all())
    assert abs(tensors["lm_head.weight"].float().std().item() - 0.02) < 2e-3
    head = read_tensors(eagle)
    assert "fc.bias" in head and not EAGLE_SHARED & set(head)
    stamps = [f.stat().st_mtime_ns for f in sorted(tmp_path.rglob("*.safetensors"))]
    random_pair(tmp_path, SMALL, shard_bytes=64 * 1024)
    assert [f.stat().st_mtime_ns for f in sorted(tmp_path.rglob("*.safetensors"))] == stamps


def test_random_pair_decodes_with_its_eagle_head_losslessly(tmp_path: Path) -> None:
    target, eagle = random_pair(tmp_path, SMALL)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    worker = build_target(target, max_requests=2, max_len=64, keep_features=True)
    drafter = build_drafter(eagle, target_path=target, max_requests=2, max_len=64)
    spec = SpeculativeEngine(worker, drafter).generate(
        prompts, max_new_tokens=6, state=build_states([3], worker, drafter)[3]
    )
    plain = SpeculativeEngine(worker, None).generate(prompts, max_new_tokens=6, state=None)
    assert [len(r.token_ids) for r in spec] == [6, 6]
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(len(r.accept_lengths) >= 1 for r in spec)
