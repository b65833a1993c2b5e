"""Public EAGLE-1/2 heads (SafeAILab's layout) load and compute what SafeAILab's cnets.py does.

The reference below follows cnets.py step by step, with `transformers`' own Llama modules:
`fc(cat(embed(x[j+1]), f[j]))`, then a LlamaDecoderLayer whose layer 0 has no input norm
(cnets: `if self.index != 0: self.input_layernorm = ...`), no final norm, the target's LM head.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specpair.models.loading import CheckpointError, eagle_layout, load_eagle, load_llama
from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_drafter
from specpair.runtime.draft.drafters import EagleDrafter
from specpair.runtime.gpu.fused import fuse_decoder
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout

T = 12


def public_head(path: Path, target: Path, *, bias: bool, own_embed: bool, fmt: str) -> Path:
    """A random head as SafeAILab publishes one: a Llama config with `bias`, and `fc.*`,
    `layers.0.*` without `input_layernorm` (often `pytorch_model.bin`)."""
    path.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=1, bias=bias, architectures=["LlamaForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], 16
    gen = torch.Generator().manual_seed(4)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    tensors = {
        "fc.weight": rand(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": rand(cfg["num_attention_heads"] * hd, h),
        "layers.0.self_attn.k_proj.weight": rand(cfg["num_key_value_heads"] * hd, h),
        "layers.0.self_attn.v_proj.weight": rand(cfg["num_key_value_heads"] * hd, h),
        "layers.0.self_attn.o_proj.weight": rand(h, cfg["num_attention_heads"] * hd),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(hd // 2),  # older heads saved it
    }
    if bias:
        tensors["fc.bias"] = rand(h)
    if own_embed:
        tensors["embed_tokens.weight"] = rand(cfg["vocab_size"], h)
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


def reference(
    head: Path, target: Path, tokens: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """cnets.py Model.forward over one sequence from position 0, then the target's LM head."""
    cfg = LlamaConfig.from_pretrained(head)
    cfg._attn_implementation = "eager"
    file = head / "pytorch_model.bin"
    if file.is_file():
        w = torch.load(file, weights_only=True)
    else:
        from safetensors.torch import load_file

        w = load_file(head / "model.safetensors")
    base = load_llama(target)
    embed = w.get("embed_tokens.weight", base.model.embed_tokens.weight)
    fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in w)
    fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")})
    layer = LlamaDecoderLayer(cfg, 0)
    layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
    layer.load_state_dict(
        {k[9:]: v for k, v in w.items() if k.startswith("layers.0.") and "rotary" not in k}
    )
    x = fc(torch.cat((nn.functional.embedding(tokens, embed), features), -1))
    positions = torch.arange(tokens.shape[1])[None]
    cos_sin = LlamaRotaryEmbedding(cfg)(x, positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    return base.lm_head(out)


def ours(head: nn.Module, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    cache = KVCache.for_model(head.args, max_requests=1, max_len=T)  # type: ignore[arg-type]
    layout = BatchLayout.causal([cache.alloc()], [0], [T])
    hidden = head(tokens, features, torch.arange(T)[None], cache.bind(layout))
    return head.logits(hidden)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("bias", "own_embed", "fmt"),
    [(True, False, "bin"), (False, True, "safetensors"), (False, False, "bin")],
    ids=["bias-bin", "own-embed", "no-bias-bin"],
)
def test_public_eagle_head_matches_cnets(
    tmp_path: Path, bias: bool, own_embed: bool, fmt: str
) -> None:
    target = make_tiny_llama(tmp_path / "target", seed=1, tokenizer=False)
    path = public_head(tmp_path / "head", target, bias=bias, own_embed=own_embed, fmt=fmt)
    assert eagle_layout(path) == "eagle" and eagle_layout(target) is None
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 320, (1, T), generator=gen)
    features = torch.randn(1, T, 64, generator=gen)
    with torch.no_grad():
        ref = reference(path, target, tokens, features)
        head = load_eagle(path, target)
        torch.testing.assert_close(ours(head, tokens, features), ref, atol=1e-5, rtol=1e-5)
        # The GPU's fused layer, run in plain torch here, skips the missing norm too.
        fused = fuse_decoder(load_eagle(path, target))
        torch.testing.assert_close(ours(fused, tokens, features), ref, atol=1e-5, rtol=1e-5)
    drafter = build_drafter(path, target_path=target, max_requests=1, max_len=64)
    assert isinstance(drafter, EagleDrafter)


def test_config_bias_without_fc_bias_is_refused(tmp_path: Path) -> None:
    target = make_tiny_llama(tmp_path / "target", seed=1, tokenizer=False)
    path = public_head(tmp_path / "head", target, bias=False, own_embed=False, fmt="bin")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "bias": True}))
    with pytest.raises(CheckpointError, match=r"missing \['fc\.bias'\]"):
        load_eagle(path, target)


def test_draft_kind_must_match_the_checkpoint(tmp_path: Path) -> None:
    from draft_service.rounds import DraftRounds
    from specpair.config import DraftConfig, ServerConfig

    target = make_tiny_llama(tmp_path / "target", seed=1, tokenizer=False)
    head = public_head(tmp_path / "head", target, bias=True, own_embed=False, fmt="bin")
    server = ServerConfig("127.0.0.1:0")
    with pytest.raises(CheckpointError, match=r"head: an EAGLE head, but --draft-kind is 'model'"):
        DraftRounds(DraftConfig(server, head))
    with pytest.raises(CheckpointError, match=r"target: not an EAGLE head, but --draft-kind is"):
        DraftRounds(DraftConfig(server, target, draft_kind="eagle", target_path=target))
    rounds = DraftRounds(DraftConfig(server, head, draft_kind="eagle", target_path=target))
    assert isinstance(rounds.drafter, EagleDrafter)
