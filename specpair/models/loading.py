"""Load Hugging Face Llama checkpoints (config via `transformers`, weights via `safetensors`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from specpair.models.eagle import EagleHead
from specpair.models.llama import LlamaModel, ModelArgs, rope_inv_freq

EAGLE_ARCHITECTURE = "SpecpairEagleHead"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: missing files, wrong architecture, bad keys."""


def read_args(path: str | Path, *, allow_eagle: bool = False) -> ModelArgs:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path}: no config.json (expected a Hugging Face checkpoint directory)"
        )
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = list(getattr(cfg, "architectures", None) or [])
    allowed = {"LlamaForCausalLM"} | ({EAGLE_ARCHITECTURE} if allow_eagle else set())
    if cfg.model_type != "llama" or (archs and not set(archs) & allowed):
        raise CheckpointError(
            f"{path}: unsupported architecture {archs or cfg.model_type!r}; "
            f"specpair serves Llama-family checkpoints ({', '.join(sorted(allowed))})"
        )
    return ModelArgs.from_hf(cfg)


def is_eagle_checkpoint(path: str | Path) -> bool:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return EAGLE_ARCHITECTURE in (cfg.get("architectures") or [])


def read_tensors(path: Path, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, sharded or not (only `wanted` names if given)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if wanted is None or name in wanted:
                    tensors[name] = f.get_tensor(name)
    return tensors


def _load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = set(module.state_dict())
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    module.load_state_dict(tensors, strict=True, assign=True)


def load_llama(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaModel:
    path = Path(path)
    args = read_args(path)
    with torch.device("meta"):
        model = LlamaModel(args)
    tensors = read_tensors(path)
    if args.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    _load_into(model, {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, path)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.eval()


def load_eagle(
    path: str | Path,
    target_path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> EagleHead:
    """The EAGLE head at `path`, with the embedding and LM head of the target at `target_path`."""
    path, target_path = Path(path), Path(target_path)
    args, target_args = read_args(path, allow_eagle=True), read_args(target_path)
    if not is_eagle_checkpoint(path):
        raise CheckpointError(
            f"{path}: not an EAGLE head (architectures lacks {EAGLE_ARCHITECTURE})"
        )
    with torch.device("meta"):
        head = EagleHead(args, target_args)
    tensors = read_tensors(path)
    shared = read_tensors(target_path, {"model.embed_tokens.weight", "lm_head.weight"})
    tensors["embed_tokens.weight"] = shared["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = shared.get("lm_head.weight", shared["model.embed_tokens.weight"])
    _load_into(head, {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, path)
    head.inv_freq = rope_inv_freq(args).to(device)
    return head.eval()
