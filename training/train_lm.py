"""Train a Llama-architecture causal LM (the target or the standalone draft) on the corpus.

python -m training.train_lm --kind target --tokenizer models/target --out models/target
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from training import corpus as corpus_mod
from training.common import (
    Batches,
    Schedule,
    autocast,
    curve_stats,
    device_name,
    heldout_windows,
    lm_perplexity,
    pick_device,
    save_run,
    seed_all,
    train_loop,
)

SEQ_LEN = 1024  # also max_position_embeddings: RoPE is not trained past it
# Sized so target + draft + EAGLE head in bf16 plus three tokenizers stay under 25 MB.
SHAPES: dict[str, dict[str, int]] = {
    "target": dict(
        hidden_size=320,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=40,
        intermediate_size=640,
    ),
    "draft": dict(
        hidden_size=160,
        num_hidden_layers=4,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=448,
    ),
}
DEFAULTS: dict[str, dict[str, float]] = {
    "target": {"lr": 2e-3, "seconds": 230.0},
    "draft": {"lr": 3e-3, "seconds": 130.0},
}


def build_config(kind: str, eot_id: int) -> LlamaConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=corpus_mod.VOCAB_SIZE,
        max_position_embeddings=SEQ_LEN,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    kwargs.update(SHAPES[kind])
    return LlamaConfig(**kwargs)


def train_lm(
    kind: str,
    train_ids: np.ndarray,
    heldout_ids: np.ndarray,
    out_dir: Path,
    plots_dir: Path,
    *,
    steps: int | None,
    seconds: float | None,
    batch: int,
    seq_len: int = SEQ_LEN,
    lr: float | None = None,
    seed: int = 0,
    eval_tokens: int = 1_000_000,
) -> dict[str, object]:
    """Train, save bf16 safetensors (tokenizer files must already be in `out_dir`), evaluate."""
    seed_all(seed)
    device = pick_device()
    config = build_config(kind, eot_id=0)
    model = LlamaForCausalLM(config).to(device)  # type: ignore[arg-type]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{kind}] {n_params / 1e6:.2f}M params on {device_name(device)}: {SHAPES[kind]}")
    batches = iter(Batches(train_ids, seq_len, batch, device, seed))

    def loss_fn() -> torch.Tensor:
        w = next(batches)
        with autocast(device):
            hidden = model.model(input_ids=w[:, :-1]).last_hidden_state
            logits = model.lm_head(hidden)
        return F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())

    if steps is None and seconds is None:
        seconds = DEFAULTS[kind]["seconds"]
    sched = Schedule(peak_lr=lr or DEFAULTS[kind]["lr"], warmup=100, steps=steps, seconds=seconds)
    t0 = time.time()
    model.train()
    curve = train_loop(kind, list(model.parameters()), loss_fn, sched, device, batch * seq_len)
    train_s = time.time() - t0

    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # Evaluate what is shipped: the bf16 weights, reloaded.
    shipped = LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.bfloat16).to(device)  # type: ignore[arg-type]
    ppl = lm_perplexity(shipped.eval(), heldout_windows(heldout_ids, seq_len, eval_tokens))
    print(f"[{kind}] held-out perplexity {ppl:.3f} (bf16 weights, <= {eval_tokens} tokens)")
    stats: dict[str, object] = {
        "kind": kind,
        "params": n_params,
        "steps": len(curve),
        "batch": batch,
        "seq_len": seq_len,
        **curve_stats(curve, batch * seq_len, train_s),
        "heldout_ppl": round(ppl, 3),
        "device": device_name(device),
    }
    save_run(
        out_dir,
        stats,
        curve,
        plots_dir / f"{kind}_loss.png",
        f"{kind}: {n_params / 1e6:.2f}M params, {len(curve)} steps x {batch * seq_len} tokens",
        batch * seq_len,
        f"held-out ppl {ppl:.2f}",
    )
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kind", choices=sorted(SHAPES), required=True)
    p.add_argument("--tokenizer", type=Path, default=Path("models/target"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plots", type=Path, default=Path("training/plots"))
    p.add_argument("--steps", type=int, default=None, help="fixed step count (overrides seconds)")
    p.add_argument("--seconds", type=float, default=None, help="training-time budget")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-bytes", type=int, default=200_000_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    corpus = corpus_mod.collect(a.max_bytes)
    tok = corpus_mod.load_tokenizer(a.tokenizer)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.out.resolve() != a.tokenizer.resolve():
        corpus_mod.save_tokenizer(tok, a.out, SEQ_LEN)
    train_lm(
        a.kind,
        corpus_mod.encode(tok, corpus.train),
        corpus_mod.encode(tok, corpus.heldout),
        a.out,
        a.plots,
        steps=a.steps,
        seconds=a.seconds,
        batch=a.batch,
        seq_len=a.seq_len,
        lr=a.lr,
        seed=a.seed,
    )


if __name__ == "__main__":
    main()
