"""Shared training plumbing: seeds, batches, the time-budgeted AdamW loop, evaluation, records."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device) -> AbstractContextManager[object]:
    """bf16 autocast on GPU; plain fp32 on CPU (the CPU runs are smoke tests)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def model_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU (the CPU runs are smoke tests)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def frozen_lm(path: Path, device: torch.device) -> LlamaForCausalLM:
    """A trained LM read from `path` onto `device` in `model_dtype`, in eval mode, no grads."""
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=model_dtype(device))
    model = model.to(device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    return model


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batches:
    """Random windows of `seq_len + 1` tokens from one token stream held on the device."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch: int, device: torch.device, seed: int):
        self.stream = torch.from_numpy(ids.astype(np.int64)).to(device)
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.span = torch.arange(seq_len + 1, device=device)

    def __iter__(self) -> Iterator[torch.Tensor]:
        high = len(self.stream) - self.seq_len - 1
        while True:
            starts = torch.randint(
                0, high, (self.batch,), generator=self.gen, device=self.span.device
            )
            yield self.stream[starts[:, None] + self.span]  # [B, T + 1]


def heldout_windows(ids: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] covering the first `max_tokens` held-out tokens."""
    n = min(len(ids) - 1, max_tokens) // seq_len
    rows = [ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def lm_perplexity(model: nn.Module, windows: torch.Tensor, batch: int = 32) -> float:
    """Token-level held-out perplexity of a causal LM (run in the model's own dtype)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch].to(device)
        logits = model(input_ids=w[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    return math.exp(total / max(count, 1))


def heldout_by_step(
    step_stats: Callable[[torch.Tensor], Sequence[Sequence[float]]],
    windows: torch.Tensor,
    device: torch.device,
    shape: tuple[int, int],
    batch: int = 16,
) -> np.ndarray:
    """Per unroll step, each statistic `step_stats` gives a batch of held-out windows, averaged
    over the batches: [steps, stats] (`shape`)."""
    sums = np.zeros(shape)
    with torch.no_grad(), autocast(device):
        for i in range(0, len(windows), batch):
            st = step_stats(windows[i : i + batch].to(device))
            sums += np.array([[float(v) for v in s] for s in st])
    return sums / max(1, -(-len(windows) // batch))


@dataclass(frozen=True)
class Schedule:
    """AdamW with linear warm-up then cosine decay to `floor` x peak, for `steps` or `seconds`."""

    peak_lr: float
    warmup: int
    steps: int | None = None  # fixed length; else measured from `seconds` after a few steps
    seconds: float | None = None
    floor: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    log_every: int = 50

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError("give exactly one of steps or seconds")

    def lr(self, step: int, total: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, total - self.warmup))
        return self.peak_lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * frac)))


# Steps timed to turn a seconds budget into a fixed step count before warm-up ends, so the
# cosine schedule is fixed from the start of decay (the count is printed for exact re-runs).
_TIME_FROM, _TIME_TO = 5, 25


def train_loop(
    name: str,
    params: list[nn.Parameter],
    loss_fn: Callable[[], torch.Tensor],
    sched: Schedule,
    device: torch.device,
    tokens_per_step: int,
) -> list[float]:
    """Run AdamW on `loss_fn` and return the per-step training loss."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": sched.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=sched.peak_lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    total = sched.steps if sched.steps is not None else 10**9
    losses: list[torch.Tensor] = []
    t0 = time.time()
    t_from = t0
    step = 0
    while step < total:
        if sched.steps is None and step in (_TIME_FROM, _TIME_TO):
            sync(device)
            if step == _TIME_FROM:
                t_from = time.time()
            else:
                dt = (time.time() - t_from) / (_TIME_TO - _TIME_FROM)
                assert sched.seconds is not None
                total = max(sched.warmup + 1, int((sched.seconds - (time.time() - t0)) / dt) + step)
                print(
                    f"[{name}] {dt * 1e3:.1f} ms/step -> {total} steps (reproduce: --steps {total})"
                )
        lr = sched.lr(step, total)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, sched.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        step += 1
        if step % sched.log_every == 0 or step == total:
            recent = torch.stack(losses[-sched.log_every :]).mean().item()
            el = time.time() - t0
            print(
                f"[{name}] step {step}/{total} loss {recent:.4f} lr {lr:.2e} "
                f"{tokens_per_step * step / el / 1e6:.2f}M tok/s {el:.0f}s",
                flush=True,
            )
    curve = torch.stack(losses).float().cpu().tolist()
    tail = ", ".join(f"{v:.3f}" for v in curve[-10:])
    print(f"[{name}] {len(curve)} steps in {time.time() - t0:.0f}s; last losses: {tail}")
    return curve


def plot_loss(curve: list[float], path: Path, title: str, tokens_per_step: int, note: str) -> None:
    """Small PNG of the training loss (raw and smoothed) against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(1, len(curve) + 1) * tokens_per_step / 1e6
    y = np.asarray(curve)
    smooth = np.copy(y)
    for i in range(1, len(y)):
        smooth[i] = 0.95 * smooth[i - 1] + 0.05 * y[i]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)
    ax.plot(x, y, lw=0.5, alpha=0.4, label="step")
    ax.plot(x, smooth, lw=1.5, label="EMA 0.95")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("loss")
    ax.set_ylim(top=float(np.percentile(y, 99)) if len(y) > 10 else None)
    ax.set_title(f"{title}\n{note}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"saved {path}")


def curve_stats(curve: list[float], tokens_per_step: int, train_s: float) -> dict[str, object]:
    """What every training_stats.json says of the loop: tokens seen, seconds, the final loss."""
    return {
        "tokens_seen": len(curve) * tokens_per_step,
        "train_seconds": round(train_s, 1),
        "final_train_loss": round(sum(curve[-20:]) / len(curve[-20:]), 4),
    }


def save_run(
    out_dir: Path,
    stats: dict[str, object],
    curve: list[float],
    plot: Path,
    title: str,
    tokens_per_step: int,
    note: str,
) -> None:
    """The run's record: its loss plot at `plot` and its stats beside the weights."""
    plot_loss(curve, plot, title, tokens_per_step, note)
    (out_dir / "training_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
