"""Load a published EAGLE-3 head (SafeAILab's EAGLE-3, SGLang's `LlamaForCausalLMEagle3`).

Layout: `fc.weight` [h, 3h] (a bias where the checkpoint has one), `midlayer.*` (attention q/k/v
over 2h), `norm.weight`, `lm_head.weight` [draft_vocab_size, h], `d2t` [draft_vocab_size] and
`t2d` [vocab_size]; optionally `embed_tokens.weight` (else the target's).

The target layers whose outputs feed `fc` are named in config.json under one of two conventions,
one layer apart (`aux_layers`; worked example for a 32-layer target):

    SpecForge / SGLang: eagle_config.eagle_aux_hidden_state_layer_ids [2, 16, 29]
        id i = the output of layer i (SGLang captures it entering layer i + 1) -> outputs 2, 16, 29
    vLLM / speculators: eagle_aux_hidden_state_layer_ids [2, 16, 29] at the top level
        id i = the state entering layer i, the output of layer i - 1        -> outputs 1, 15, 28
    no ids (SafeAILab's heads; either of the above without the key): every runtime's default,
        the states entering layers 2, L//2, L - 3                           -> outputs 1, 15, 28
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specpair.models.eagle3 import Eagle3Head
from specpair.models.loading import (
    CheckpointError,
    _load_into,
    _read_json,
    check_context,
    read_args,
    read_tensors,
)
from specpair.models.rope import rope_inv_freq

KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True, slots=True)
class LayerIds:
    """Where a published layout keeps its layer ids and what an id names."""

    runtime: str
    key: tuple[str, ...]  # the path in config.json
    place: str  # that path, in words
    shift: int  # 0-based layer output = id + shift
    meaning: str  # what id i names


# sglang models/llama.py set_eagle3_layers_to_capture: layers_to_capture = [val + 1 for val in
# layer_ids], captured entering those layers; SpecForge writes eagle_config's ids that way.
SGLANG = LayerIds(
    "SGLang / SpecForge", ("eagle_config", KEY), "under eagle_config", 0, "the output of layer i"
)
# vllm models/llama.py: `if idx in self.aux_hidden_state_layers` before layer idx runs, with the
# top-level ids as given (eagle3_utils.get_eagle3_aux_layers_from_config); speculators writes them.
VLLM = LayerIds("vLLM / speculators", (KEY,), "at the top level", -1, "the state entering layer i")
CONVENTIONS = (SGLANG, VLLM)
# What a config's own names say serves it: SGLang registers LlamaForCausalLMEagle3; vLLM's class
# is Eagle3LlamaForCausalLM, speculators' Eagle3Speculator with its speculators_* keys.
SGLANG_ARCHITECTURES = {"LlamaForCausalLMEagle3"}
VLLM_ARCHITECTURES = {"Eagle3LlamaForCausalLM", "Eagle3Speculator"}
VLLM_KEYS = ("speculators_config", "speculators_model_type")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The outputs an EAGLE-3 head without layer ids reads, low / middle / high: SGLang's and
    vLLM's capture of the states entering layers 2, L//2, L - 3, as SafeAILab's EAGLE-3 does."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def aux_layers(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The 0-based target layers whose outputs the EAGLE-3 head at `path` reads, in its order.

    Ids under eagle_config read as SGLang's, at the top level as vLLM's, none as the default (see
    the module docstring). Refused: an id naming no layer output that a later layer reads, and
    readings that disagree — both keys naming different layers, or ids only under the key that
    the runtime named by the config (architectures, speculators_* keys) ignores, naming other
    layers than the default it reads instead."""
    file = Path(path) / "config.json"
    raw = _read_json(file)
    default = default_aux_layers(target_layers)
    readings: dict[str, tuple[int, ...]] = {}  # who reads which ids how -> the outputs
    for c in CONVENTIONS:
        if (ids := _lookup(raw, c.key)) is not None:
            outputs = _outputs(file, c, ids, target_layers)
            readings[f"{c.runtime} reads {KEY} {ids} {c.place} as outputs"] = outputs
    named = _named_runtime(raw)
    if readings and named is not None and _lookup(raw, named.key) is None:
        readings[f"{named.runtime}, which the config names, ignores them: its default"] = default
    if len(set(readings.values())) > 1:
        raise CheckpointError(
            f"{file}: ambiguous layer ids: "
            + "; ".join(f"{text} {list(outputs)}" for text, outputs in readings.items())
            + f". Keep the ids under the key meant, with an architecture whose runtime reads "
            f"it: eagle_config.{KEY} names layer outputs (SGLang's LlamaForCausalLMEagle3), a "
            f"top-level {KEY} the states entering layers, one more (vLLM's "
            "Eagle3LlamaForCausalLM)"
        )
    if not readings:
        _check_range(file, f"no {KEY}: the default {list(default)}", default, target_layers)
    return next(iter(readings.values()), default)


def _named_runtime(raw: dict[str, Any]) -> LayerIds | None:
    """The runtime a config's own names say serves it; None for SafeAILab's plain
    `LlamaForCausalLM` (its code reads no ids)."""
    archs = set(raw.get("architectures") or [])
    if archs & VLLM_ARCHITECTURES or any(key in raw for key in VLLM_KEYS):
        return VLLM
    return SGLANG if archs & SGLANG_ARCHITECTURES else None


def _lookup(raw: dict[str, Any], key: tuple[str, ...]) -> Any:
    for name in key[:-1]:
        raw = raw.get(name) or {}
        if not isinstance(raw, dict):
            return None
    return raw.get(key[-1])


def _outputs(file: Path, c: LayerIds, ids: Any, target_layers: int) -> tuple[int, ...]:
    what = f"{KEY} {ids} {c.place}"
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise CheckpointError(f"{file}: {what} must be a list of ints")
    outputs = tuple(i + c.shift for i in ids)
    _check_range(
        file, f"{what} ({c.runtime}: id i is {c.meaning})", outputs, target_layers, c.shift
    )
    return outputs


def _check_range(
    file: Path, what: str, outputs: tuple[int, ...], layers: int, shift: int = 0
) -> None:
    # A feature is a state some later layer reads: outputs 0 .. L - 2 (neither runtime's Llama
    # captures the last layer's output, and the embedding is no layer's).
    bad = [o - shift for o in outputs if not 0 <= o <= layers - 2]
    if bad:
        raise CheckpointError(
            f"{file}: {what}: {bad[0]} is not a layer whose output a later layer reads "
            f"({-shift} .. {layers - 2 - shift} for a {layers}-layer target)"
        )


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
