"""EAGLE-1 draft head: one decoder layer that predicts the target's next feature.

Row j of the head's input joins the embedding of token x[j+1] with the target's final-normed
hidden state f[j] (`fc(cat(embed(x[j+1]), f[j]))`), runs one Llama decoder layer at position j,
and outputs a prediction of f[j+1]; the target's LM head turns it into draft logits. The head
reuses the target's embedding and LM head, loaded from the target checkpoint.

Two layouts of the same computation load into it (`loading.eagle_layout`): specpair's own, and
SafeAILab's EAGLE-1/2 heads as published, whose layer 0 has no input norm (its `fc` output goes
straight into attention) and whose `fc` has a bias only when config.json's `bias` says so.

Given a token map (`draft_vocab.py`), the LM head holds only the map's rows of the target's and
the head drafts over those ids: its logits come back on the target's vocabulary, -inf elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specpair.models.args import ModelArgs
from specpair.models.draft_vocab import mapped_argmax, on_target_vocab, target_ids
from specpair.models.llama import Attend, DecoderLayer
from specpair.models.rope import rope_cos_sin, rope_inv_freq, rope_scale


class EagleHead(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        target_args: ModelArgs,
        *,
        fc_bias: bool = True,
        input_norm: bool = True,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if args.hidden_size != target_args.hidden_size or args.vocab_size != target_args.vocab_size:
            raise ValueError(
                "EAGLE head hidden_size/vocab_size "
                f"({args.hidden_size}/{args.vocab_size}) must equal the target's "
                f"({target_args.hidden_size}/{target_args.vocab_size})"
            )
        self.args = args
        hidden = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, hidden)  # the target's
        # The target's LM head, or its rows at the token map's ids (d2t: `draft_vocab.py`).
        self.lm_head = nn.Linear(hidden, draft_vocab_size or args.vocab_size, bias=False)
        self.d2t: Tensor | None
        self.register_buffer(
            "d2t",
            None if draft_vocab_size is None else torch.zeros(draft_vocab_size, dtype=torch.long),
        )
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.feature_width = hidden  # a feature row: the target's final hidden state
        self.layers = nn.ModuleList([DecoderLayer(args, 0, input_norm=input_norm)])
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.rope_scale = rope_scale(args)

    def forward(
        self, tokens: Tensor, features: Tensor, positions: Tensor, attend: Attend
    ) -> Tensor:
        # tokens: [B, T] (x[j+1]), features: [B, T, H] (f[j]), positions: [B, T] (j) -> [B, T, H]
        x = self.fc(torch.cat((self.embed_tokens(tokens), features.to(self.fc.weight.dtype)), -1))
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype, self.rope_scale)
        return self.layers[0](x, cos, sin, attend)

    def logits(self, hidden: Tensor) -> Tensor:
        """Float logits on the target vocabulary [.., V]."""
        draft = self.lm_head(hidden).float()
        return draft if self.d2t is None else on_target_vocab(draft, self.d2t, self.args.vocab_size)

    def named_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """Float logits over the ids this head can name [.., N] and their target ids [N] (None:
        N is the whole target vocabulary): `logits` without the -inf elsewhere."""
        draft = self.lm_head(hidden).float()
        return draft, None if self.d2t is None else target_ids(self.d2t)

    def greedy(self, hidden: Tensor) -> Tensor:
        draft = self.lm_head(hidden).float()
        return draft.argmax(-1) if self.d2t is None else mapped_argmax(draft, self.d2t)
