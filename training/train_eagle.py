"""Train the EAGLE head on the frozen target's final-norm hidden states.

    python -m training.train_eagle --target models/target --out models/eagle

Loss per unroll step k (weight 0.7**k): smooth-L1 between the predicted and the true next
feature, plus CE_WEIGHT x cross-entropy of lm_head(prediction) against the target's own next-token
distribution softmax(lm_head(f[j+1])). EAGLE-1 weighs the cross-entropy 0.1; for this small
target 1.0 (with a wider MLP) accepted clearly more (models/README.md, ablation).
Unrolling a few steps (rows read the head's own earlier predictions, see eagle_head.unroll)
trains the head for the chains it drafts at serving time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from training import corpus as corpus_mod
from training.common import (
    Batches,
    Schedule,
    autocast,
    curve_stats,
    device_name,
    frozen_lm,
    heldout_by_step,
    heldout_windows,
    model_dtype,
    pick_device,
    save_run,
    seed_all,
    train_loop,
)
from training.eagle_head import EagleHead, head_config, save_head

CE_WEIGHT = 1.0
INTERMEDIATE_SIZE = 1024  # wider than the target's 640: one layer has to do all the work
STEP_DECAY = 0.7
NOISE = 0.1  # EAGLE-style uniform noise on true input features, relative to their RMS


def eagle_losses(
    head: EagleHead,
    target: LlamaForCausalLM,
    w: torch.Tensor,
    steps: int,
    noise: float,
    ce_weight: float = CE_WEIGHT,
) -> tuple[torch.Tensor, list[tuple[float, float, float]]]:
    """w: [B, T + 1] token windows. Returns the loss and per step (smooth-L1, CE, top-1 match)."""
    with torch.no_grad():
        f = target.model(input_ids=w[:, :-1]).last_hidden_state  # [B, T, H], after final norm
        emb = target.model.embed_tokens(w[:, 1:-1])  # embed(x[j+1]) for rows j = 0 .. T-2
        f_in, f_next = f[:, :-1], f[:, 1:]
        p_next = F.softmax(target.lm_head(f_next).float(), dim=-1)  # [B, T-1, V]
        top_next = p_next.argmax(-1)
        if noise > 0:
            scale = noise * f_in.float().pow(2).mean().sqrt()
            f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * scale
    outs = head.unroll(emb.to(f_in.dtype), f_in, steps)
    total = torch.zeros((), device=w.device)
    stats: list[tuple[float, float, float]] = []
    for k, pred in enumerate(outs):
        pred, tgt_f, tgt_p = pred[:, k:], f_next[:, k:], p_next[:, k:]  # rows with a full chain
        reg = F.smooth_l1_loss(pred.float(), tgt_f.float())
        logp = F.log_softmax(target.lm_head(pred).float(), dim=-1)
        ce = -(tgt_p * logp).sum(-1).mean()
        total = total + STEP_DECAY**k * (reg + ce_weight * ce)
        match = (logp.argmax(-1) == top_next[:, k:]).float().mean()
        stats.append((reg.detach(), ce.detach(), match.detach()))  # type: ignore[arg-type]
    return total, stats


def train_eagle(
    target_dir: Path,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    out_dir: Path,
    plots_dir: Path,
    *,
    steps: int | None,
    seconds: float | None,
    batch: int,
    seq_len: int = 1024,
    unroll: int = 3,
    lr: float = 2e-3,
    ce_weight: float = CE_WEIGHT,
    intermediate_size: int | None = INTERMEDIATE_SIZE,
    seed: int = 0,
) -> dict[str, object]:
    seed_all(seed)
    device = pick_device()
    dtype = model_dtype(device)
    target = frozen_lm(target_dir, device)
    head = EagleHead(head_config(target.config, intermediate_size)).to(device)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"[eagle] {n_params / 1e6:.2f}M params, unroll {unroll}, on {device_name(device)}")
    batches = iter(Batches(train_ids, seq_len, batch, device, seed))

    def loss_fn() -> torch.Tensor:
        with autocast(device):
            loss, _ = eagle_losses(head, target, next(batches), unroll, NOISE, ce_weight)
        return loss

    sched = Schedule(peak_lr=lr, warmup=100, steps=steps, seconds=seconds, weight_decay=0.0)
    t0 = time.time()
    curve = train_loop("eagle", list(head.parameters()), loss_fn, sched, device, batch * seq_len)
    train_s = time.time() - t0

    # Held-out per-step numbers, with the head cast to bf16 as shipped and no input noise.
    head = head.to(dtype).eval()
    windows = heldout_windows(heldout_ids, seq_len, 256 * seq_len)
    per_step = heldout_by_step(
        lambda w: eagle_losses(head, target, w, unroll, 0.0)[1], windows, device, (unroll, 3)
    )
    for k, (reg, ce, match) in enumerate(per_step):
        print(f"[eagle] held-out step {k}: smooth-L1 {reg:.4f} CE {ce:.3f} top-1 match {match:.3f}")
    save_head(head, out_dir)
    stats: dict[str, object] = {
        "kind": "eagle",
        "params": n_params,
        "steps": len(curve),
        "batch": batch,
        "seq_len": seq_len,
        "unroll": unroll,
        "ce_weight": ce_weight,
        "intermediate_size": head.config.intermediate_size,
        **curve_stats(curve, batch * seq_len, train_s),
        "heldout_top1_match_by_step": [round(float(m), 4) for m in per_step[:, 2]],
        "heldout_ce_by_step": [round(float(c), 4) for c in per_step[:, 1]],
        "device": device_name(device),
    }
    save_run(
        out_dir,
        stats,
        curve,
        plots_dir / f"{out_dir.name}_loss.png",
        f"EAGLE head: {n_params / 1e6:.2f}M params, {len(curve)} steps, unroll {unroll}",
        batch * seq_len,
        "held-out top-1 match with target by step: "
        + " / ".join(f"{m:.2f}" for m in per_step[:, 2]),
    )
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, default=Path("models/target"))
    p.add_argument("--out", type=Path, default=Path("models/eagle"))
    p.add_argument("--plots", type=Path, default=Path("training/plots"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--unroll", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ce-weight", type=float, default=CE_WEIGHT)
    p.add_argument("--intermediate-size", type=int, default=INTERMEDIATE_SIZE)
    p.add_argument("--max-bytes", type=int, default=200_000_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    corpus = corpus_mod.collect(a.max_bytes)
    tok = corpus_mod.load_tokenizer(a.target)
    corpus_mod.save_tokenizer(tok, a.out, 1024)
    train_eagle(
        a.target,
        corpus_mod.encode(tok, corpus.train),
        corpus_mod.encode(tok, corpus.heldout),
        a.out,
        a.plots,
        steps=a.steps,
        seconds=a.seconds if a.steps is None else None,
        batch=a.batch,
        unroll=a.unroll,
        lr=a.lr,
        ce_weight=a.ce_weight,
        intermediate_size=a.intermediate_size,
        seed=a.seed,
    )


if __name__ == "__main__":
    main()
