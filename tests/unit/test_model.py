"""Our plain-torch Llama matches transformers' LlamaForCausalLM on the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from specpair.models.loading import CheckpointError, load_llama
from specpair.models.tiny import make_tiny_llama
from specpair.runtime.kv_cache import BatchLayout, DenseKVCache

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}


def our_logits_incremental(path: Path, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Runs `tokens` through our model in chunks (prefill then incremental), returns logits."""
    model = load_llama(path)
    cache = DenseKVCache.for_model(model.args, max_requests=2, max_len=256)
    slot, out, pos = cache.alloc(), [], 0
    for n in chunks:
        ids = torch.tensor([tokens[pos : pos + n]])
        layout = BatchLayout.causal([slot], [pos], [n])
        hidden = model(ids, torch.arange(pos, pos + n)[None], cache.bind(layout))
        cache.commit(slot, pos, range(n))
        out.append(model.logits(hidden)[0])
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 256},
        {"num_kv_heads": 1, "num_heads": 4},
    ],
    ids=["untied", "tied", "llama3-rope", "mqa"],
)
def test_logits_match_transformers(tmp_path: Path, kwargs: dict) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=7, **kwargs)
    tokens = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    prefill = our_logits_incremental(path, tokens, [150])
    incremental = our_logits_incremental(path, tokens, [100, 1, 1, 5, 43])
    torch.testing.assert_close(prefill, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(incremental, ref, atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=3)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(path / "model-00002-of-00002.safetensors"))
    model = load_llama(path)
    torch.testing.assert_close(model.model.norm.weight, tensors["model.norm.weight"])


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=3)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_llama(path)


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=3)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_llama(path)
