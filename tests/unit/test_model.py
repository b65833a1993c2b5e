"""Our plain-torch Llama matches transformers' LlamaForCausalLM on the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specpair.models.loading import CheckpointError, load_llama
from specpair.models.tiny import make_tiny_family, make_tiny_llama
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}

# YaRN over 4x the original 64 positions: the 120-token test spans both the kept and the
# interpolated band of dimensions.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def our_logits_incremental(path: Path, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Runs `tokens` through our model in chunks (prefill then incremental), returns logits."""
    model = load_llama(path)
    cache = KVCache.for_model(model.args, max_requests=2, max_len=256)
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
    cfg.update(model_type="gemma", architectures=["GemmaForCausalLM"])
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


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "cfg"),
    [
        (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
        (LlamaConfig, LlamaForCausalLM, {"hidden_act": "gelu"}),
        (LlamaConfig, LlamaForCausalLM, {"hidden_act": "gelu_pytorch_tanh"}),
        (LlamaConfig, LlamaForCausalLM, {"hidden_act": "relu"}),
        (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        (LlamaConfig, LlamaForCausalLM, {"rope_scaling": YARN}),
        (
            LlamaConfig,
            LlamaForCausalLM,
            {"rope_scaling": {**YARN, "beta_fast": 8, "truncate": False, "attention_factor": 1.3}},
        ),
        (
            Qwen2Config,
            Qwen2ForCausalLM,
            {"rope_scaling": {**YARN, "mscale": 2, "mscale_all_dim": 1}},
        ),
    ],
    ids=[
        "qwen2",
        "mistral",
        "llama-biases",
        "gelu",
        "gelu-tanh",
        "relu",
        "linear-rope",
        "yarn",
        "yarn-untruncated",
        "yarn-mscale",
    ],
)
def test_family_logits_match_transformers(
    tmp_path: Path,
    config_cls: type[PretrainedConfig],
    model_cls: type[PreTrainedModel],
    cfg: dict,
) -> None:
    path = make_tiny_family(tmp_path / "m", config_cls, model_cls, seed=11, **cfg)
    tokens = torch.randint(0, 320, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = model_cls.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    ours = our_logits_incremental(path, tokens, [100, 1, 19])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_qwen2_biases_reach_the_model(tmp_path: Path) -> None:
    """Qwen2 has q/k/v biases and no o_proj bias; each is loaded, none is silently dropped."""
    path = make_tiny_family(tmp_path / "m", Qwen2Config, Qwen2ForCausalLM, seed=11)
    attn = load_llama(path).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_act": "quick_gelu"}, r"config\.json: hidden_act 'quick_gelu' is not implemented"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            r"config\.json: rope_scaling type 'longrope' is not implemented",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"config\.json: rope_parameters type 'dynamic'",
        ),
        (
            {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}},
            r"config\.json: KeyError: .*low_freq_factor",
        ),
    ],
    ids=["activation", "longrope", "dynamic-v5", "llama3-without-factor"],
)
def test_unimplemented_config_is_refused_by_key(tmp_path: Path, change: dict, match: str) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=3, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_llama(path)


def test_mistral_window_shorter_than_context_is_refused(tmp_path: Path) -> None:
    path = make_tiny_family(
        tmp_path / "m", MistralConfig, MistralForCausalLM, seed=11, sliding_window=64
    )
    with pytest.raises(CheckpointError, match=r"sliding_window 64 is shorter than .*256 tokens"):
        load_llama(path)
    with pytest.raises(CheckpointError, match=r"sliding_window 64 .*100 tokens"):
        load_llama(path, context=100)
    tokens = torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    model = load_llama(path, context=64)  # the window covers the context: plain attention
    hf = MistralForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        cache = KVCache.for_model(model.args, max_requests=1, max_len=64)
        slot = cache.alloc()
        hidden = model(
            torch.tensor([tokens]),
            torch.arange(60)[None],
            cache.bind(BatchLayout.causal([slot], [0], [60])),
        )
    torch.testing.assert_close(model.logits(hidden)[0], ref, atol=1e-5, rtol=1e-5)


def test_qwen2_sliding_layers_are_refused(tmp_path: Path) -> None:
    """Qwen2 slides only where use_sliding_window is set, from layer max_window_layers on."""
    window = {"use_sliding_window": True, "sliding_window": 32}
    path = make_tiny_family(
        tmp_path / "a", Qwen2Config, Qwen2ForCausalLM, seed=11, **window, max_window_layers=1
    )
    with pytest.raises(CheckpointError, match=r"sliding_window 32 is shorter"):
        load_llama(path, context=64)
    # Every layer below max_window_layers attends fully: nothing slides, nothing to refuse.
    path = make_tiny_family(
        tmp_path / "b", Qwen2Config, Qwen2ForCausalLM, seed=11, **window, max_window_layers=2
    )
    assert load_llama(path, context=64).args.sliding_window is None
