"""EAGLE-3 draft head, as SafeAILab's EAGLE-3 (`cnets.py`) and SGLang's `LlamaForCausalLMEagle3`
compute it.

Row j of an extend reads the target's hidden states after three of its layers, concatenated
(f3[j] [3h], the layers of `aux_layers`), and the token x[j+1]:

    x   = fc(f3[j])                                          # [h], no norm
    a   = attn(cat(input_layernorm(embed(x[j+1])), hidden_norm(x)))   # q/k/v read 2h
    r   = x + a
    out = r + mlp(post_attention_layernorm(r))                 # pre-norm output
    logits = lm_head(norm(out))                                # over the draft vocabulary

A draft step feeds `out` (width h, so no `fc`) back in as the next row's hidden state. The head
has its own `lm_head` over a reduced vocabulary of `draft_vocab_size` target ids: draft id i is
target id `i + d2t[i]`; `t2d` [V] marks which target ids the draft can name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specpair.models.args import ModelArgs
from specpair.models.draft_vocab import mapped_argmax, on_target_vocab, target_ids
from specpair.models.llama import MLP, Attend, Attention, RMSNorm
from specpair.models.rope import rope_cos_sin, rope_inv_freq, rope_scale


class Eagle3Layer(nn.Module):
    """The midlayer: a Llama decoder layer whose attention reads [embedding ‖ hidden]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = Attention(args, 0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * h, attn.n_heads * attn.head_dim, bias=args.qkv_bias)
        attn.k_proj = nn.Linear(2 * h, attn.n_kv * attn.head_dim, bias=args.qkv_bias)
        attn.v_proj = nn.Linear(2 * h, attn.n_kv * attn.head_dim, bias=args.qkv_bias)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attend: Attend
    ) -> Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), -1)
        r = hidden + self.self_attn(x, cos, sin, attend)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        target_args: ModelArgs,
        *,
        draft_vocab_size: int,
        aux_layers: tuple[int, ...],
        fc_bias: bool = False,
    ) -> None:
        super().__init__()
        if args.vocab_size != target_args.vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocab_size {args.vocab_size} must equal the target's "
                f"{target_args.vocab_size} (draft_vocab_size is the reduced one)"
            )
        fc_in = len(aux_layers) * target_args.hidden_size
        if fc_in == args.hidden_size:  # the authors tell fc input from own output by width
            raise ValueError(f"fc input width {fc_in} equals hidden_size: ambiguous")
        self.args = args
        self.aux_layers = aux_layers
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, h)  # the target's unless shipped
        self.fc = nn.Linear(fc_in, h, bias=fc_bias)
        self.feature_width = fc_in  # a feature row: the target's aux layers, concatenated
        self.midlayer = Eagle3Layer(args)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.d2t: Tensor
        self.t2d: Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(args.vocab_size, dtype=torch.bool))
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.rope_scale = rope_scale(args)

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, attend: Attend
    ) -> Tensor:
        # tokens, positions: [B, T]; features: [B, T, 3h] (target layers, extend) or [B, T, h]
        # (this head's own previous output, a draft step) -> pre-norm output [B, T, h]
        hidden = features.to(self.fc.weight.dtype)
        if hidden.shape[-1] != self.args.hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype, self.rope_scale)
        return self.midlayer(embeds, hidden, cos, sin, attend)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Float logits over the draft vocabulary [.., draft_vocab_size]."""
        return self.lm_head(self.norm(hidden)).float()

    def logits(self, hidden: Tensor) -> Tensor:
        """Float logits on the target vocabulary [.., V], -inf at ids the draft cannot name
        (`draft_vocab.on_target_vocab`): rejection sampling against the target's p stays exact."""
        return on_target_vocab(self.draft_logits(hidden), self.d2t, self.args.vocab_size)

    def named_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """`draft_logits` and the target id of each draft id: `logits` without the -inf
        elsewhere (a draft vocabulary of 32 000 is a quarter of Llama-3's 128 256)."""
        return self.draft_logits(hidden), target_ids(self.d2t)

    def greedy(self, hidden: Tensor) -> Tensor:
        """`logits(hidden).argmax(-1)` without the target-wide logits, ties included."""
        return mapped_argmax(self.draft_logits(hidden), self.d2t)

    def target_ids(self) -> Tensor:
        """Target id of each draft id [draft_vocab_size]."""
        return target_ids(self.d2t)
