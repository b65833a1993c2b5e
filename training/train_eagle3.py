"""Train an EAGLE-3 head on the frozen target with the training-time test (TTT).

    python -m training.train_eagle3 --target models/target --out models/eagle3

The target gives, per window, the hidden states after its layers `--layers` (concatenated, the
head's input) and its logits. The draft vocabulary is the `--draft-vocab` most frequent target
ids of the training stream (EAGLE-3's `d2t`/`t2d`). Loss per TTT step k (weight 0.8**k, as
SafeAILab's traineagle3): cross-entropy of the head's draft-vocabulary logits against the
target's distribution restricted to the draft vocabulary, on rows whose target argmax is in it
(EAGLE-3 drops the feature regression of EAGLE-1). Step k of row j runs on the head's own
outputs of steps < k (eagle3_head.Eagle3Head.ttt).

With `--data` (written by `training.regen`) the stream is the target's own continuations, mixed
with `--true-fraction` of corpus text; `--init-from-target` starts the LM head at the target's
rows for the draft vocabulary and the final norm at the target's (the head then learns to land
in the space the target's own head reads, instead of from noise).

    python -m training.regen --out /tmp/regen.npz
    python -m training.train_eagle3 --data /tmp/regen.npz --init-from-target --out models/eagle3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
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
from training.eagle3_head import Eagle3Head, draft_vocab, head_config, save_head

STEP_DECAY = 0.8
LAYERS = [1, 2, 4]  # low, middle, high of 6 (SGLang's capture needs ids < num_layers - 1)


def ttt_losses(
    head: Eagle3Head, target: LlamaForCausalLM, w: torch.Tensor, steps: int, layers: list[int]
) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    """w: [B, T + 1] windows. Returns the loss and per step (CE, top-1 match with the target)."""
    t = w.shape[1] - 1
    n = t - steps  # rows with a full chain of `steps` predictions inside the window
    with torch.no_grad():
        out = target.model(input_ids=w[:, :-1], output_hidden_states=True)
        # hidden_states[i + 1] is the output of layer i (pre-norm for i < num_layers - 1).
        aux = torch.cat([out.hidden_states[i + 1][:, :n] for i in layers], dim=-1)
        tlogits = target.lm_head(out.last_hidden_state).float()  # [B, T, V]: at p predicts p+1
        # Once per window, not per step: step k reads positions k+1 .. k+n of the same rows.
        tops = tlogits.argmax(-1)
        masks = head.t2d[tops].float()  # rows whose target argmax the draft can name
        probs = F.softmax(tlogits[..., head.t2d], dim=-1)  # [B, T, draft vocab]
        del tlogits
    logits = head.ttt(target.model.embed_tokens, w[:, 1 : n + steps], aux, steps)
    total = torch.zeros((), device=w.device)
    stats = []
    for k, lg in enumerate(logits):
        at = slice(k + 1, k + 1 + n)  # the target at position j+1+k
        top, mask, p = tops[:, at], masks[:, at], probs[:, at]
        logp = F.log_softmax(lg.float(), dim=-1)
        ce = -((p * logp).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
        total = total + STEP_DECAY**k * ce
        drafted = logp.argmax(-1) + head.d2t[logp.argmax(-1)]
        stats.append((ce.detach(), (drafted == top).float().mean().detach()))
    return total, stats  # type: ignore[return-value]


def train_eagle3(
    target_dir: Path,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    out_dir: Path,
    plots_dir: Path,
    *,
    steps: int | None,
    seconds: float | None,
    batch: int,
    seq_len: int,
    ttt_steps: int,
    vocab: int,
    layers: list[int],
    intermediate_size: int,
    lr: float,
    seed: int,
    init_from_target: bool = False,
    init_from: Path | None = None,
    data_note: str = "corpus",
) -> dict[str, object]:
    seed_all(seed)
    device = pick_device()
    dtype = model_dtype(device)
    target = frozen_lm(target_dir, device)
    counts = torch.from_numpy(np.bincount(train_ids, minlength=target.config.vocab_size))
    start = load_file(str(init_from / "model.safetensors")) if init_from else None
    if start is not None:  # a trained head goes on: its draft vocabulary stays
        d2t, t2d = start["d2t"], start["t2d"]
        vocab = len(d2t)
    else:
        d2t, t2d = draft_vocab(counts, vocab)
    coverage = float(counts[t2d].sum() / counts.sum())
    print(f"[eagle3] draft vocab {vocab}: {coverage:.2%} of training tokens")
    cfg = head_config(target.config, vocab, layers, intermediate_size)
    head = Eagle3Head(cfg, d2t, t2d).to(device)
    if start is not None:
        missing, unexpected = head.load_state_dict(
            {k: v.float() for k, v in start.items()}, strict=False
        )  # the rotary buffers are not saved
        if unexpected or any(not k.startswith("rotary") for k in missing):
            raise ValueError(f"{init_from}: not this head's layout ({missing=}, {unexpected=})")
    elif init_from_target:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[d2t + torch.arange(vocab)].float())
            head.norm.weight.copy_(target.model.norm.weight.float())
    n_params = sum(p.numel() for p in head.parameters())
    print(f"[eagle3] {n_params / 1e6:.2f}M params, TTT {ttt_steps} steps, on {device_name(device)}")
    batches = iter(Batches(train_ids, seq_len, batch, device, seed))

    def loss_fn() -> torch.Tensor:
        with autocast(device):
            loss, _ = ttt_losses(head, target, next(batches), ttt_steps, layers)
        return loss

    sched = Schedule(peak_lr=lr, warmup=100, steps=steps, seconds=seconds, weight_decay=0.0)
    t0 = time.time()
    curve = train_loop("eagle3", list(head.parameters()), loss_fn, sched, device, batch * seq_len)
    train_s = time.time() - t0
    if device.type == "cuda":
        print(f"[eagle3] peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")

    head = head.to(dtype).eval()
    windows = heldout_windows(heldout_ids, seq_len, 256 * seq_len)
    per_step = heldout_by_step(
        lambda w: ttt_losses(head, target, w, ttt_steps, layers)[1], windows, device, (ttt_steps, 2)
    )
    for k, (ce, match) in enumerate(per_step):
        print(f"[eagle3] held-out step {k}: CE {ce:.3f} top-1 match {match:.3f}")
    save_head(head, out_dir)
    stats: dict[str, object] = {
        "kind": "eagle3",
        "params": n_params,
        "steps": len(curve),
        "batch": batch,
        "seq_len": seq_len,
        "ttt_steps": ttt_steps,
        "draft_vocab_size": vocab,
        "draft_vocab_coverage": round(coverage, 4),
        "aux_layers": layers,
        "data": data_note,
        "init_from_target": init_from_target,
        "init_from": str(init_from) if init_from else None,
        "intermediate_size": intermediate_size,
        **curve_stats(curve, batch * seq_len, train_s),
        "heldout_top1_match_by_step": [round(float(m), 4) for m in per_step[:, 1]],
        "heldout_ce_by_step": [round(float(c), 4) for c in per_step[:, 0]],
        "device": device_name(device),
    }
    save_run(
        out_dir,
        stats,
        curve,
        plots_dir / f"{out_dir.name}_loss.png",
        f"EAGLE-3 head: {n_params / 1e6:.2f}M params, {len(curve)} steps, TTT {ttt_steps}",
        batch * seq_len,
        "held-out top-1 match by step: " + " / ".join(f"{m:.2f}" for m in per_step[:, 1]),
    )
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", type=Path, default=Path("models/target"))
    p.add_argument("--out", type=Path, default=Path("models/eagle3"))
    p.add_argument("--plots", type=Path, default=Path("training/plots"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seconds", type=float, default=470.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=6144)
    p.add_argument("--layers", default=",".join(map(str, LAYERS)))
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-bytes", type=int, default=200_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=None, help="training.regen's .npz")
    p.add_argument("--true-fraction", type=float, default=0.25, help="corpus share with --data")
    p.add_argument("--init-from-target", action="store_true")
    p.add_argument("--init-from", type=Path, default=None, help="a trained head to go on from")
    a = p.parse_args()
    tok = corpus_mod.load_tokenizer(a.target)
    corpus_mod.save_tokenizer(tok, a.out, 1024)
    if a.data is None:
        corpus = corpus_mod.collect(a.max_bytes)
        train = corpus_mod.encode(tok, corpus.train)
        heldout = corpus_mod.encode(tok, corpus.heldout)
        note = "corpus"
    else:
        data = np.load(a.data)
        regen, heldout = data["regen"], data["heldout"]
        # true text / (true + regenerated) = true_fraction
        n_true = int(len(regen) * a.true_fraction / max(1e-9, 1 - a.true_fraction))
        train = np.concatenate([regen, data["train"][:n_true]])
        note = f"regenerated {len(regen)} + corpus {min(n_true, len(data['train']))} tokens"
    train_eagle3(
        a.target,
        train,
        heldout,
        a.out,
        a.plots,
        steps=a.steps,
        seconds=a.seconds if a.steps is None else None,
        batch=a.batch,
        seq_len=a.seq_len,
        ttt_steps=a.ttt_steps,
        vocab=a.draft_vocab,
        layers=[int(x) for x in a.layers.split(",")],
        intermediate_size=a.intermediate_size,
        lr=a.lr,
        seed=a.seed,
        init_from_target=a.init_from_target,
        init_from=a.init_from,
        data_note=note,
    )


if __name__ == "__main__":
    main()
