"""Grow an EAGLE-3 head alongside its target (`grow.py`): the same function, a big head's cost.

The head reads three target layers' outputs, and `grow.py` keeps a small layer's output at
[0, h) of the big residual with the constant c at dim P = h (extra layers add 0 and come after
the small ones, so the layer ids stay right). So, with the target's `Growth`:
- fc [h, 3h] -> [H, 3H]: input chunk k lands at [kH, kH + h); row P reads chunk 0's P, so the
  head's residual carries c at P as the target's does;
- the midlayer's q/k/v read [input_norm(embed) ‖ hidden_norm(hidden)] (2h): each half grows as
  a decoder layer's projection does, the halves land at [0, H) and [H, 2H); norms, o, the MLP
  grow as a decoder layer's;
- the reduced vocabulary grows too (to 32 000 rows, SGLang's Llama-3 heads, where the target
  has room): real draft ids keep their rows and their d2t; each extra draft id i maps to an
  extra target id and its LM-head row reads −PAD_WEIGHT at P, so it never wins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from specpair.models.eagle3 import Eagle3Head
from training.growth import PAD_WEIGHT, Growth

DRAFT_VOCAB = 32_000


def big_draft_vocab(small_draft: int, small_vocab: int, big_vocab: int) -> int:
    """Rows of the grown head's LM head: extra draft ids take extra target ids, one each."""
    return max(small_draft, min(DRAFT_VOCAB, small_draft + big_vocab - small_vocab))


def eagle3_tensors(
    growth: Growth, small: dict[str, Tensor]
) -> tuple[dict[str, torch.Size], Callable[[str], Tensor]]:
    """(name -> shape, make(name)) of the grown head: the names it ships (no embedding: the
    target's is read at load, as SGLang does)."""
    g = growth
    h, hh = g.small.hidden_size, g.big.hidden_size
    chunks = small["fc.weight"].shape[1] // h
    small_draft, v_small = small["lm_head.weight"].shape[0], g.small.vocab_size
    draft = big_draft_vocab(small_draft, v_small, g.big.vocab_size)
    v_dims = torch.arange(g.small.head_dim)

    def both_halves(grow_half: Callable[[Tensor], Tensor], w: Tensor) -> Tensor:
        # [out, 2h] -> [out', 2H]: each half grown as a decoder layer's input projection
        return torch.cat((grow_half(w[:, :h]), grow_half(w[:, h:])), dim=1)

    def lm_head() -> Tensor:
        w = torch.zeros(draft, hh, device=g.device)
        w[:small_draft, :h] = small["lm_head.weight"].float()
        w[small_draft:, g.pad_dim] = -PAD_WEIGHT
        return w

    def d2t() -> Tensor:
        out = torch.full((draft,), v_small - small_draft, dtype=torch.long)
        out[:small_draft] = small["d2t"].long().cpu()
        return out

    def t2d() -> Tensor:
        out = torch.zeros(g.big.vocab_size, dtype=torch.bool)
        out[torch.arange(draft) + d2t()] = True
        return out

    mid = {k.removeprefix("midlayer."): v for k, v in small.items() if k.startswith("midlayer.")}
    makers: dict[str, Callable[[], Tensor]] = {
        "fc.weight": lambda: g.fc(small["fc.weight"])[0],
        "midlayer.hidden_norm.weight": lambda: g.norm(mid["hidden_norm.weight"]),
        "midlayer.input_layernorm.weight": lambda: g.norm(mid["input_layernorm.weight"]),
        "midlayer.self_attn.q_proj.weight": lambda: both_halves(
            g.q_proj, mid["self_attn.q_proj.weight"]
        ),
        "midlayer.self_attn.k_proj.weight": lambda: both_halves(
            lambda w: g.kv_proj(w, g.qk_dims), mid["self_attn.k_proj.weight"]
        ),
        "midlayer.self_attn.v_proj.weight": lambda: both_halves(
            lambda w: g.kv_proj(w, v_dims), mid["self_attn.v_proj.weight"]
        ),
        "midlayer.self_attn.o_proj.weight": lambda: g.o_proj(mid["self_attn.o_proj.weight"]),
        "midlayer.post_attention_layernorm.weight": lambda: g.norm(
            mid["post_attention_layernorm.weight"]
        ),
        "midlayer.mlp.gate_proj.weight": lambda: g.mlp_in(mid["mlp.gate_proj.weight"]),
        "midlayer.mlp.up_proj.weight": lambda: g.mlp_in(mid["mlp.up_proj.weight"]),
        "midlayer.mlp.down_proj.weight": lambda: g.mlp_out(mid["mlp.down_proj.weight"]),
        "norm.weight": lambda: g.norm(small["norm.weight"], final=True),
        "lm_head.weight": lm_head,
        "d2t": d2t,
        "t2d": t2d,
    }
    with torch.device("meta"):
        layers = tuple(range(chunks))  # which ones does not change a shape
        head = Eagle3Head(g.big, g.big, draft_vocab_size=draft, aux_layers=layers)
    state = head.state_dict()
    shapes = {name: state[name].shape for name in makers}
    return shapes, lambda name: makers[name]()
