"""The EAGLE-1 head (fc + one Llama decoder layer) with a parallel multi-step unroll.

Row j of the head reads `fc(cat(embed(x[j+1]), f[j]))`, where f is the target's final-norm hidden
state, and predicts f[j+1]; draft logits are the target's `lm_head` of that prediction. At serving
time the head runs on its own predictions. `unroll` computes, for every row at once, what the head
produces k steps into such a chain (k = 0 .. steps-1), so training and the acceptance probe see
exactly the serving computation without a loop over positions.

Worked example, steps = 3, query row j = 5 at step 2: the chain's last true row is 3. It attends
to step-0 keys of rows 0..3 (true features, as the draft's KV cache holds after extend), the
step-1 key of row 4 and its own step-2 key at row 5 (the two drafted positions).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

ARCH = "SpecpairEagleHead"
LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
STATE_KEYS = frozenset({"fc.weight", "fc.bias"} | {f"layers.0.{k}" for k in LAYER_KEYS})


@lru_cache(maxsize=16)
def unroll_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """Bool [n, (step + 1) * n]: which keys query row j of unroll step `step` may read.

    Key block i, row m is visible iff (i == 0 and m <= j - step) or (i >= 1 and m == j - step + i).
    """
    j = torch.arange(n, device=device)[:, None]
    m = torch.arange(n, device=device)[None, :]
    blocks = [m <= j - step] + [m == j - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.rotary = LlamaRotaryEmbedding(config)  # inv_freq is a non-persistent buffer
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def unroll(
        self, embeds_next: torch.Tensor, feats: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """embeds_next, feats: [B, n, H] = embed(x[j+1]), f[j]. Returns `steps` x [B, n, H].

        Output k at row j is the step-k prediction of f[j+1]; rows j < k have no full chain and
        must be ignored by the caller.
        """
        b, n, _ = feats.shape
        layer: LlamaDecoderLayer = self.layers[0]  # type: ignore[assignment]
        attn: LlamaAttention = layer.self_attn
        heads = int(self.config.num_attention_heads)
        kv_heads = int(self.config.num_key_value_heads or heads)
        d = int(self.config.head_dim or self.config.hidden_size // heads)
        pos = torch.arange(n, device=feats.device)[None]
        cos, sin = self.rotary(feats, pos)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        inp = feats
        for k in range(steps):
            x = self.fc(torch.cat([embeds_next, inp], dim=-1))
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, n, heads, d).transpose(1, 2)  # [B, heads, n, d]
            kk = attn.k_proj(h).view(b, n, kv_heads, d).transpose(1, 2)
            v = attn.v_proj(h).view(b, n, kv_heads, d).transpose(1, 2)
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk)
            values.append(v)
            kcat = torch.cat(keys, dim=2).repeat_interleave(heads // kv_heads, dim=1)
            vcat = torch.cat(values, dim=2).repeat_interleave(heads // kv_heads, dim=1)
            if k == 0:
                o = F.scaled_dot_product_attention(q, kcat, vcat, is_causal=True)
            else:
                mask = unroll_mask(n, k, feats.device)
                o = F.scaled_dot_product_attention(q, kcat, vcat, attn_mask=mask)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, heads * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            outs.append(x)
            # Next step's row j continues the chain: its input feature is this row j-1 output.
            inp = torch.cat([feats[:, :1], x[:, :-1]], dim=1)
        return outs


def head_config(target: LlamaConfig, intermediate_size: int | None = None) -> LlamaConfig:
    cfg = LlamaConfig.from_dict(target.to_dict())
    cfg.num_hidden_layers = 1
    cfg.architectures = [ARCH]
    cfg.tie_word_embeddings = False
    if intermediate_size is not None:
        cfg.intermediate_size = intermediate_size
    return cfg


def save_head(head: EagleHead, out_dir: Path) -> None:
    """config.json (LlamaConfig + architectures) and model.safetensors with STATE_KEYS, bf16."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to(torch.bfloat16).contiguous().cpu()
        for k, v in head.state_dict().items()
        if k in STATE_KEYS
    }
    assert set(state) == STATE_KEYS, sorted(set(state) ^ STATE_KEYS)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(head.config.to_json_string())
    cfg["dtype"] = "bfloat16"
    # Readers that predate rope_parameters look for a top-level rope_theta.
    cfg["rope_theta"] = dict(head.config.rope_parameters or {})["rope_theta"]
    cfg["architectures"] = [ARCH]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_head(model_dir: Path, device: torch.device, dtype: torch.dtype) -> EagleHead:
    cfg = LlamaConfig.from_pretrained(str(model_dir))
    head = EagleHead(cfg)
    missing, unexpected = head.load_state_dict(
        load_file(str(model_dir / "model.safetensors")), strict=False
    )
    assert not unexpected and not [k for k in missing if k in STATE_KEYS], (missing, unexpected)
    return head.to(device=device, dtype=dtype).eval()
