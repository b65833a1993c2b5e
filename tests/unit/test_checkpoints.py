"""Weights as the Hub publishes them: index-listed shards, `.bin` pickles, Mistral's extra file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpair.models.loading import CheckpointError, load_llama, weight_names
from specpair.models.tiny import make_tiny_llama


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = make_tiny_llama(tmp_path / "m", seed=5, tokenizer=False)
    return path, load_file(path / "model.safetensors")


def write_sharded(
    path: Path, tensors: dict[str, torch.Tensor], n: int, stem: str, save: Callable[..., None]
) -> dict[str, str]:
    """`tensors` in `n` shards `{stem}-0000i-of-0000n{suffix}` written by `save`; the index's
    weight map (tensor name -> shard file)."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        part = {k: tensors[k] for k in names[i::n]}
        file = stem.format(i=i + 1, n=n)
        save(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    return weight_map


def assert_loaded(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    state = load_llama(path).state_dict()
    for name, tensor in tensors.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


def test_safetensors_index_loads_only_listed_shards(tiny: tuple) -> None:
    path, tensors = tiny
    (path / "model.safetensors").unlink()
    weight_map = write_sharded(path, tensors, 2, "model-{i:05d}-of-{n:05d}.safetensors", save_file)
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    # A leftover shard the index does not list (an older revision): were it read, it would not
    # match the architecture.
    save_file({"model.stale.weight": torch.zeros(2)}, str(path / "model-old.safetensors"))
    assert_loaded(path, tensors)
    assert weight_names(path) == set(tensors)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"index\.json: lists model-00002-of-00002"):
        load_llama(path)


def test_mistral_consolidated_file_is_ignored(tiny: tuple) -> None:
    path, tensors = tiny
    # Mistral repos also ship the same weights under their own names (`layers.0.attention.wq`).
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(64, 64)},
        str(path / "consolidated.safetensors"),
    )
    assert_loaded(path, tensors)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights .*consolidated\.\* is Mistral's own"):
        load_llama(path)


def test_pytorch_model_bin_loads(tiny: tuple) -> None:
    path, tensors = tiny
    (path / "model.safetensors").unlink()
    torch.save(tensors, path / "pytorch_model.bin")
    assert_loaded(path, tensors)
    assert weight_names(path) == set(tensors)


def test_sharded_bin_loads_through_its_index(tiny: tuple) -> None:
    path, tensors = tiny
    (path / "model.safetensors").unlink()
    weight_map = write_sharded(path, tensors, 3, "pytorch_model-{i:05d}-of-{n:05d}.bin", torch.save)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.save({"junk": torch.zeros(1)}, path / "pytorch_model-unlisted.bin")
    assert_loaded(path, tensors)
    assert weight_names(path) == set(tensors)


def test_bin_with_code_is_refused(tiny: tuple) -> None:
    """weights_only: a pickle that would run code on load is refused, naming the file."""
    path, _ = tiny
    (path / "model.safetensors").unlink()
    torch.save({"model": torch.nn.Linear(2, 2)}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: unreadable weights"):
        load_llama(path)


def test_truncated_safetensors_names_the_file(tiny: tuple) -> None:
    path, _ = tiny
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable weights"):
        load_llama(path)


def test_wrong_shape_names_the_tensor(tiny: tuple) -> None:
    path, tensors = tiny
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_llama(path)
