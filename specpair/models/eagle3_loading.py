"""Load a published EAGLE-3 head (SafeAILab's EAGLE-3, SGLang's `LlamaForCausalLMEagle3`).

Layout: `fc.weight` [h, 3h] (a bias where the checkpoint has one), `midlayer.*` (attention q/k/v
over 2h), `norm.weight`, `lm_head.weight` [draft_vocab_size, h], `d2t` [draft_vocab_size] and
`t2d` [vocab_size]; optionally `embed_tokens.weight` (else the target's). The target layers whose
outputs feed `fc` are config.json's `eagle_config.eagle_aux_hidden_state_layer_ids` (or the same
key at top level), else SGLang's default low / middle / high = [1, L//2 - 1, L - 4] for a target
of L layers. An id i is the output of target layer i, which SGLang captures as the input of
layer i + 1, so ids run from 0 to L - 2.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specpair.models.eagle3 import Eagle3Head
from specpair.models.llama import rope_inv_freq
from specpair.models.loading import (
    CheckpointError,
    _load_into,
    _read_json,
    check_context,
    read_args,
    read_tensors,
)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's capture of an EAGLE-3 target without layer ids: low, middle, high."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def aux_layers(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head at `path` reads (see the module docstring)."""
    file = Path(path) / "config.json"
    raw = _read_json(file)
    eagle_config = raw.get("eagle_config") or {}
    ids = eagle_config.get(
        "eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids")
    )
    key = "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        ids, key = list(default_aux_layers(target_layers)), f"no {key}: the default"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids:
        raise CheckpointError(f"{file}: {key} must be a list of ints")
    bad = [i for i in ids if not 0 <= i <= target_layers - 2]
    if bad:
        raise CheckpointError(
            f"{file}: {key} {ids}: {bad[0]} is not a layer whose output a later layer reads "
            f"(0 .. {target_layers - 2} for a {target_layers}-layer target)"
        )
    return tuple(ids)


def load_eagle3(
    path: str | Path,
    target_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    context: int | None = None,
) -> Eagle3Head:
    path, target_path = Path(path), Path(target_path)
    args, target_args = read_args(path, allow_eagle=True), read_args(target_path)
    check_context(path, args, context or args.max_position_embeddings)
    layers = aux_layers(path, target_args.num_layers)
    tensors = read_tensors(path)
    config_file = path / "config.json"
    if "lm_head.weight" not in tensors:  # SGLang: a head without one shares the target's
        head_weight = read_tensors(target_path, {"lm_head.weight", "model.embed_tokens.weight"})
        tensors["lm_head.weight"] = head_weight.get(
            "lm_head.weight", head_weight["model.embed_tokens.weight"]
        )
    draft_vocab = len(tensors["lm_head.weight"])
    if "d2t" not in tensors:
        if draft_vocab != args.vocab_size:
            raise CheckpointError(
                f"{path}: lm_head.weight has {draft_vocab} rows, vocab_size is "
                f"{args.vocab_size}, and there is no d2t mapping draft ids to target ids"
            )
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        tensors["t2d"] = torch.ones(args.vocab_size, dtype=torch.bool)
    _check_mapping(path, tensors["d2t"], args.vocab_size)
    tensors.setdefault("t2d", _t2d(tensors["d2t"], args.vocab_size))
    if "embed_tokens.weight" not in tensors:
        if args.hidden_size != target_args.hidden_size:
            raise CheckpointError(
                f"{path}: hidden_size {args.hidden_size} != the target's "
                f"{target_args.hidden_size}, so the head needs its own embed_tokens.weight"
            )
        embed = read_tensors(target_path, {"model.embed_tokens.weight"})
        tensors["embed_tokens.weight"] = embed["model.embed_tokens.weight"]
    try:
        with torch.device("meta"):
            head = Eagle3Head(
                args,
                target_args,
                draft_vocab_size=draft_vocab,
                aux_layers=layers,
                fc_bias="fc.bias" in tensors,
            )
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: {exc}") from None
    buffers = {"d2t": torch.long, "t2d": torch.bool}
    _load_into(
        head,
        {
            k: v.to(device=device, dtype=buffers.get(k, dtype))
            for k, v in tensors.items()
            if not k.endswith("rotary_emb.inv_freq")
        },
        path,
    )
    head.inv_freq = rope_inv_freq(args).to(device)
    return head.eval()


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t.long()] = True
    return t2d


def _check_mapping(path: Path, d2t: torch.Tensor, vocab_size: int) -> None:
    ids = torch.arange(len(d2t)) + d2t.long()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise CheckpointError(f"{path}: d2t maps a draft id outside the target vocabulary")
    if len(set(ids.tolist())) != len(ids):
        raise CheckpointError(f"{path}: d2t maps two draft ids to one target id")
