"""EAGLE-3 heads as published load and compute what SafeAILab's EAGLE-3 (`cnets.py`) and SGLang's
`LlamaForCausalLMEagle3` compute; the target sends the layers the head reads.

The reference follows cnets.py's `LlamaDecoderLayeremb` + `Model.forward` step by step with plain
tensors and `transformers`' rotary embedding: hidden = fc(f3) (no norm); attention over
cat(input_layernorm(embed), hidden_norm(hidden)); residual from the un-normed hidden; MLP;
logits = lm_head(norm(out)); a draft step feeds `out` back without fc; draft id i is target id
i + d2t[i] (`topK_genrate`: `topk_index + self.d2t[topk_index]`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from specpair.models.eagle3 import Eagle3Head
from specpair.models.eagle3_loading import aux_layers, default_aux_layers, load_eagle3
from specpair.models.loading import CheckpointError, eagle_layout, load_llama
from specpair.models.tiny import make_tiny_eagle3, make_tiny_llama
from specpair.runtime.build import build_drafter
from specpair.runtime.draft.drafters import EagleDrafter
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout

T, H, VOCAB, DRAFT_VOCAB = 10, 64, 320, 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_llama(root / "target", seed=1, num_layers=4, tokenizer=False)
    return target, make_tiny_eagle3(root / "head", target, seed=5, draft_vocab=DRAFT_VOCAB)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference(
    head: Path, target: Path, tokens: torch.Tensor, aux: torch.Tensor, steps: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """cnets.py on one sequence: extend rows (tokens [T], aux [T, 3H]) from position 0, then a
    greedy chain of `len(steps)` draft steps, each feeding its own output and the mapped token.
    Returns the extend's draft logits [T, Vd] and the chain's target ids."""
    cfg = LlamaConfig.from_pretrained(head)
    w = load_file(head / "model.safetensors")
    embed = load_llama(target).model.embed_tokens.weight
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, 16
    rotary = LlamaRotaryEmbedding(cfg)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def layer(tok: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        n = len(tok)
        m = "midlayer."
        x = torch.cat(
            (
                rms(embed[tok], w[f"{m}input_layernorm.weight"], eps),
                rms(hidden, w[f"{m}hidden_norm.weight"], eps),
            ),
            -1,
        )
        q = (x @ w[f"{m}self_attn.q_proj.weight"].T).view(n, nh, d).transpose(0, 1)
        k = (x @ w[f"{m}self_attn.k_proj.weight"].T).view(n, nkv, d).transpose(0, 1)
        v = (x @ w[f"{m}self_attn.v_proj.weight"].T).view(n, nkv, d).transpose(0, 1)
        cos, sin = rotary(x, torch.arange(start, start + n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        keys.append(k[0])
        values.append(v)
        kk = torch.cat(keys, 1).repeat_interleave(nh // nkv, 0)
        vv = torch.cat(values, 1).repeat_interleave(nh // nkv, 0)
        scores = q[0] @ kk.transpose(1, 2) / math.sqrt(d)  # [heads, n, start + n]
        causal = torch.arange(start + n)[None] <= torch.arange(start, start + n)[:, None]
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vv
        r = hidden + attn.transpose(0, 1).reshape(n, nh * d) @ w[f"{m}self_attn.o_proj.weight"].T
        y = rms(r, w[f"{m}post_attention_layernorm.weight"], eps)
        mlp = F.silu(y @ w[f"{m}mlp.gate_proj.weight"].T) * (y @ w[f"{m}mlp.up_proj.weight"].T)
        return r + mlp @ w[f"{m}mlp.down_proj.weight"].T

    def logits(out: torch.Tensor) -> torch.Tensor:
        return rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T

    out = layer(tokens, aux @ w["fc.weight"].T, 0)
    extend_logits = logits(out)
    chain, last = [], out[-1:]
    for k in range(len(steps)):
        draft_id = int(logits(last).argmax(-1))
        chain.append(draft_id + int(w["d2t"][draft_id]))
        if k + 1 < len(steps):
            last = layer(torch.tensor(chain[-1:]), last, T + k)
    return extend_logits, chain


def test_layout_detected_and_layers_read(pair, tmp_path: Path) -> None:
    target, head = pair
    assert eagle_layout(head) == "eagle3" and eagle_layout(target) is None
    assert default_aux_layers(32) == (1, 15, 28)  # SGLang: capture inputs of layers 2, 16, 29
    assert aux_layers(head, 4) == (1, 1, 0)  # no key: the default for L = 4
    cfg = json.loads((head / "config.json").read_text())
    for ids, ok in (([0, 1, 2], True), ([1, 2, 3], False)):
        (tmp_path / "config.json").write_text(
            json.dumps({**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
        )
        if ok:
            assert aux_layers(tmp_path, 4) == tuple(ids)
        else:
            with pytest.raises(CheckpointError, match=r"config\.json: eagle_aux.*3 is not"):
                aux_layers(tmp_path, 4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"the default \[1, 0, -1\]: -1 is not a layer"):
        aux_layers(tmp_path, 3)  # SGLang's default needs 5 layers


def test_head_matches_cnets_reference(pair) -> None:
    target, path = pair
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (T,), generator=gen)
    aux = torch.randn(T, 3 * H, generator=gen)
    ref_logits, ref_chain = reference(path, target, tokens, aux, [0, 1, 2])
    head = load_eagle3(path, target)
    cache = KVCache.for_model(head.args, max_requests=1, max_len=T + 4)
    slot = cache.alloc()
    with torch.no_grad():
        out = head(
            tokens[None],
            aux[None],
            torch.arange(T)[None],
            cache.bind(BatchLayout.causal([slot], [0], [T])),
        )
        torch.testing.assert_close(head.draft_logits(out)[0], ref_logits, atol=1e-5, rtol=1e-5)
        cache.commit(slot, 0, range(T))
        # The drafter's greedy chain (logits on the target vocabulary) is the reference's.
        drafter = EagleDrafter(head, cache)
        chain, last = [], out[:, -1:]
        for k in range(3):
            full = drafter.logits(last)
            assert full.shape == (1, VOCAB)
            chain.append(int(full.argmax(-1)))
            layout = BatchLayout.causal([slot], [T + k], [1])
            last = drafter._step(torch.tensor([chain[-1:]]), last, layout)
    assert chain == ref_chain


def test_logits_on_target_vocabulary(pair) -> None:
    target, path = pair
    head: Eagle3Head = load_eagle3(path, target)
    hidden = torch.randn(4, H)
    with torch.no_grad():
        draft, full = head.draft_logits(hidden), head.logits(hidden)
    ids = head.target_ids()
    assert torch.equal(full[:, ids], draft)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(full[:, off]).all() and torch.equal(head.t2d, ~off)
    assert torch.equal(full.argmax(-1), ids[draft.argmax(-1)])


def test_greedy_is_the_argmax_of_the_target_wide_logits_ties_included(pair) -> None:
    """The graphs' greedy step takes the draft argmax mapped to its target id; it must be the
    token `logits(...).argmax` picks, also where two draft ids tie (the lower target id)."""
    target, path = pair
    head: Eagle3Head = load_eagle3(path, target)
    with torch.no_grad():
        head.lm_head.weight[5] = head.lm_head.weight[2]  # draft ids 2 and 5 always tie
        hidden = torch.randn(64, H)
        full = head.logits(hidden)
        assert torch.equal(head.greedy(hidden), full.argmax(-1))
        # a row where the tie is the maximum: both ids carry the row's top logit
        tied = hidden[:1].clone()
        head.lm_head.weight[2] = head.lm_head.weight[5] = 10 * tied[0] / tied[0].norm()
        logits = head.logits(tied)
        ids = head.target_ids()
        assert logits[0, ids[2]] == logits[0, ids[5]] == logits.max()
        assert head.greedy(tied).item() == ids[2].item() == logits.argmax(-1).item()


def test_target_sends_the_layers_the_head_reads(pair) -> None:
    """forward_aux's features are the outputs of those layers (transformers'
    hidden_states[i + 1]), concatenated in order, before the final norm."""
    target, _ = pair
    ours = load_llama(target)
    ref = LlamaForCausalLM.from_pretrained(target).eval()
    tokens = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    cache = KVCache.for_model(ours.args, max_requests=1, max_len=T)
    layout = BatchLayout.causal([cache.alloc()], [0], [T])
    with torch.no_grad():
        hidden, aux = ours.forward_aux(tokens, torch.arange(T)[None], cache.bind(layout), (2, 0, 1))
        states = ref(tokens, output_hidden_states=True).hidden_states
    expected = torch.cat([states[3], states[1], states[2]], -1)
    torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, states[-1], atol=1e-5, rtol=1e-5)


def test_bad_checkpoints_are_refused(pair, tmp_path: Path) -> None:
    target, path = pair
    w = load_file(path / "model.safetensors")
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    from safetensors.torch import save_file

    save_file({**w, "d2t": w["d2t"] + VOCAB}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t maps a draft id outside"):
        load_eagle3(tmp_path, target)
    save_file({k: v for k, v in w.items() if k != "d2t"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no d2t"):
        load_eagle3(tmp_path, target)
    drafter = build_drafter(path, target_path=target, max_requests=1, max_len=32)
    assert isinstance(drafter, EagleDrafter) and isinstance(drafter.head, Eagle3Head)


def test_fused_layers_compute_what_the_plain_ones_do(pair) -> None:
    """The GPU's fused forms, run in plain torch on the CPU (the same structure, one partial
    each): a fused target's EAGLE-3 features (its layers defer their residual add, which
    `materialized` adds back) and the fused midlayer equal the unfused ones."""
    from specpair.runtime.gpu.fused import FusedEagle3Layer, fuse_decoder

    target, head = pair
    layers = aux_layers(head, 4)
    tokens, positions = torch.arange(3, 3 + T)[None], torch.arange(T)[None]
    outs = []
    for fuse in (False, True):
        model = load_llama(target)
        eagle = load_eagle3(head, target)
        if fuse:
            fuse_decoder(model)
            fuse_decoder(eagle)
            assert isinstance(eagle.midlayer, FusedEagle3Layer)
        caches = [KVCache.for_model(m.args, max_requests=1, max_len=T) for m in (model, eagle)]
        binds = []
        for c in caches:
            binds.append(c.bind(BatchLayout.causal([c.alloc()], [0], [T])))
        hidden, feats = model.forward_aux(tokens, positions, binds[0], layers)
        out = eagle(tokens, feats, positions, binds[1])
        outs.append((hidden, feats, out, eagle.logits(out[:, -1])))
    for plain, fused in zip(*outs, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert outs[0][1].shape == (1, T, 3 * H)
