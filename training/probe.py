"""Greedy acceptance probe: mean accepted draft tokens per round (bonus excluded) at chain lengths.

    python -m training.probe --models models

For each held-out prompt the target writes its greedy continuation S. Greedy speculative decoding
reproduces S exactly, so a round that starts with tokens S[:n+1] known (S[n] the bonus token)
accepts the longest prefix of drafted tokens equal to S[n+1:]. A draft token at depth k only
matters if depths < k matched, so its context is S itself: one teacher-forced pass gives every
depth for the draft LM, and eagle_head.unroll gives them for the EAGLE head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from training import corpus as corpus_mod
from training.common import device_name, frozen_lm, model_dtype, pick_device, seed_all
from training.eagle_head import load_head

TIERS = (1, 3, 7)


def mean_accept(hits: np.ndarray, start: int, tier: int) -> tuple[float, int]:
    """hits: bool [N, L, depth]: depth-k draft of a round whose bonus sits at n is right.

    Simulates the rounds of every sequence from bonus position `start` while the whole chain
    still fits in S; returns (mean accept length, rounds).
    """
    n_seq, length, _ = hits.shape
    accepted: list[int] = []
    for s in range(n_seq):
        n = start
        while n + tier <= length - 1:
            a = 0
            while a < tier and hits[s, n, a]:
                a += 1
            accepted.append(a)
            n += a + 1
    return float(np.mean(accepted)), len(accepted)


@torch.no_grad()
def greedy_continue(target: LlamaForCausalLM, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """Full recompute each step (no cache), matching a verify pass over the whole sequence."""
    seq = prompts
    for _ in range(new):
        nxt = target(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


@torch.no_grad()
def probe(
    models_dir: Path,
    heldout_ids: np.ndarray,
    *,
    n_prompts: int = 64,
    prompt_len: int = 128,
    new_tokens: int = 128,
    seed: int = 0,
    eagle_name: str = "eagle",
) -> dict[str, object]:
    seed_all(seed)
    device = pick_device()
    dtype = model_dtype(device)
    target = frozen_lm(models_dir / "target", device)
    draft = frozen_lm(models_dir / "draft", device)
    head = load_head(models_dir / eagle_name, device, dtype)
    # Prompts: seeded random windows of the held-out stream that contain no file boundary.
    rng = np.random.default_rng(seed)
    eot = 0
    rows: list[np.ndarray] = []
    while len(rows) < n_prompts:
        i = int(rng.integers(0, len(heldout_ids) - prompt_len))
        window = heldout_ids[i : i + prompt_len]
        if not (window == eot).any():
            rows.append(window)
    prompts = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
    seq = greedy_continue(target, prompts, new_tokens)  # S: [N, L]
    depth = max(TIERS)
    length = seq.shape[1]

    # Draft LM: depth k for the round with bonus at n is its argmax at position n + k.
    d_tok = draft(input_ids=seq).logits.argmax(-1)  # predicts S[p + 1] at p
    right = d_tok[:, :-1] == seq[:, 1:]  # [N, L-1]: right at p
    hits_draft = torch.zeros(len(seq), length, depth, dtype=torch.bool, device=device)
    for k in range(depth):
        hits_draft[:, : length - 1 - k, k] = right[:, k:]

    # EAGLE: depth k for the round with bonus at n is unroll step k at row n - 1 + k.
    f = target.model(input_ids=seq).last_hidden_state
    emb = target.model.embed_tokens(seq[:, 1:])
    outs = head.unroll(emb, f[:, :-1], depth)  # row j predicts S[j + 2]
    hits_eagle = torch.zeros_like(hits_draft)
    for k, pred in enumerate(outs):
        tok = target.lm_head(pred).argmax(-1)  # [N, L-1]
        ok = tok[:, :-1] == seq[:, 2:]  # row j right, j = 0 .. L-3
        # round n uses row n - 1 + k; rows < k have no full chain
        n_lo, n_hi = 1, length - 1 - k  # n - 1 + k <= L - 3
        hits_eagle[:, n_lo:n_hi, k] = ok[:, n_lo - 1 + k : n_hi - 1 + k]

    result: dict[str, object] = {
        "device": device_name(device),
        "prompts": n_prompts,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }
    for name, hits in (("draft", hits_draft), ("eagle", hits_eagle)):
        h = hits.cpu().numpy()
        for tier in TIERS:
            mean, rounds = mean_accept(h, prompt_len, tier)
            result[f"{name}_tier{tier}"] = round(mean, 3)
            result[f"{name}_tier{tier}_rounds"] = rounds
    print("greedy accept length (accepted draft tokens per round, bonus excluded)")
    print(f"{'draft kind':<12}" + "".join(f"{'tier ' + str(t):>10}" for t in TIERS))
    for name in ("draft", "eagle"):
        print(f"{name:<12}" + "".join(f"{result[f'{name}_tier{t}']:>10.3f}" for t in TIERS))
    (models_dir / eagle_name / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("models"))
    p.add_argument("--max-bytes", type=int, default=200_000_000)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--eagle", default="eagle", help="EAGLE head folder under --models")
    a = p.parse_args()
    corpus = corpus_mod.collect(a.max_bytes)
    tok = corpus_mod.load_tokenizer(a.models / "target")
    probe(a.models, corpus_mod.encode(tok, corpus.heldout), n_prompts=a.prompts, eagle_name=a.eagle)


if __name__ == "__main__":
    main()
