"""The EAGLE-3 head for training (SafeAILab's `traineagle3/cnets.py` layout), with the
training-time test (TTT) of the EAGLE-3 paper as a parallel unroll.

Row j of step 0 reads the target's hidden states after three layers, concatenated, f3[j]
[3h] → `fc` → x[j] [h], and the token x[j+1]; its midlayer attends over
`cat(input_layernorm(embed(x[j+1])), hidden_norm(x[j]))` [2h], adds attention and MLP to the
residual x[j] (not normed), and `lm_head(norm(out))` gives logits over the draft vocabulary for
position j+1. Step k >= 1 of the TTT continues row j's own chain: it reads out_{k-1}[j] (the
pre-norm output of the previous step) and the true token x[j+1+k], at RoPE position j+k, and
attends to the step-0 keys of rows 0..j (the KV cache after extend) plus its own chain's keys of
steps 1..k: exactly what the draft computes at serving time, k steps into a chain.

Worked example, steps = 3, row j = 5 at step 2: keys = step-0 rows 0..5, step-1 row 5, step-2
row 5; its query and its own key sit at position 7; it predicts the token at position 8.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

ARCH = "LlamaForCausalLMEagle3"


def ttt_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """Bool [n, (step + 1) * n]: keys query row j of TTT step `step` reads — block 0 (step-0
    keys) rows m <= j, block i >= 1 (step-i keys) row j only."""
    j = torch.arange(n, device=device)[:, None]
    m = torch.arange(n, device=device)[None, :]
    return torch.cat([m <= j] + [m == j] * step, dim=1)


class Eagle3Layer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // self.heads)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.self_attn = attn
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    def __init__(self, config: LlamaConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, int(config.draft_vocab_size), bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    def ttt(self, embed: nn.Embedding, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list:
        """tokens: [B, n + steps - 1] (x[j+1] for rows j, then the chain's true next tokens),
        aux: [B, n, 3h]. Returns `steps` x draft logits [B, n, Vd]; step k at row j predicts
        position j+1+k."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, n, _ = aux.shape
        hq, hk, d = layer.heads, layer.kv_heads, layer.head_dim
        hidden = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        for k in range(steps):
            emb = embed(tokens[:, k : k + n]).to(hidden.dtype)
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
            q = attn.q_proj(x).view(b, n, hq, d).transpose(1, 2)
            kk = attn.k_proj(x).view(b, n, hk, d).transpose(1, 2)
            v = attn.v_proj(x).view(b, n, hk, d).transpose(1, 2)
            cos, sin = self.rotary(hidden, torch.arange(k, k + n, device=aux.device)[None])
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk)
            values.append(v)
            kcat = torch.cat(keys, dim=2).repeat_interleave(hq // hk, dim=1)
            vcat = torch.cat(values, dim=2).repeat_interleave(hq // hk, dim=1)
            if k == 0:
                o = F.scaled_dot_product_attention(q, kcat, vcat, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(
                    q, kcat, vcat, attn_mask=ttt_mask(n, k, aux.device)
                )
            r = hidden + attn.o_proj(o.transpose(1, 2).reshape(b, n, hq * d))
            hidden = r + layer.mlp(layer.post_attention_layernorm(r))  # pre-norm: next input
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target ids, as EAGLE-3 stores them: d2t [size] (draft id i →
    target id i + d2t[i], ids ascending) and t2d [V] bool (target id in the draft vocab)."""
    used = torch.topk(counts.float(), size).indices.sort().values
    return used - torch.arange(size), torch.zeros(len(counts), dtype=torch.bool).index_fill_(
        0, used, True
    )


def head_config(
    target: LlamaConfig, draft_vocab_size: int, layers: list[int], intermediate_size: int
) -> LlamaConfig:
    cfg = LlamaConfig.from_dict(target.to_dict())
    cfg.num_hidden_layers = 1
    cfg.architectures = [ARCH]
    cfg.tie_word_embeddings = False
    cfg.intermediate_size = intermediate_size
    cfg.draft_vocab_size = draft_vocab_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True}
    return cfg


def save_head(head: Eagle3Head, out_dir: Path) -> None:
    """config.json and model.safetensors in the published EAGLE-3 layout (bf16; d2t/t2d as is)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16)).detach().contiguous().cpu()
        for k, v in head.state_dict().items()
        if not k.startswith("rotary")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(head.config.to_json_string())
    cfg["dtype"] = "bfloat16"
    cfg["rope_theta"] = dict(head.config.rope_parameters or {})["rope_theta"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
