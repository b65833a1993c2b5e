"""`load_shard` reads from the checkpoint only its rank's part of each tensor and gets what
slicing the whole model gets (`shard_state`), with `load_llama`'s refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import specpair.models.loading as loading
from specpair.models.loading import CheckpointError, load_llama, read_args
from specpair.models.parallel import Shard, TensorParallelLlama, load_shard, shard_state
from specpair.models.saving import checkpoint_shapes, write_shards
from specpair.models.tiny import make_tiny_family, make_tiny_llama

VOCAB = 7  # over 4 ranks: 2 rows each, the last rank's second row padding


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 heads and 4 KV heads, so each splits over 2 and 4 ranks."""
    root = tmp_path_factory.mktemp("shards")
    biased = make_tiny_family(
        root / "biased",
        LlamaConfig,
        LlamaForCausalLM,
        seed=7,
        vocab_size=VOCAB,
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
    )
    tied = make_tiny_llama(
        root / "tied",
        seed=8,
        vocab_size=VOCAB,
        num_kv_heads=4,
        tie_word_embeddings=True,
        tokenizer=False,
    )
    # the biased model in 20 KB files with their index json, as the Hub shards big models
    state = load_file(biased / "model.safetensors")
    config = json.loads((biased / "config.json").read_text())
    sharded = write_shards(
        root / "sharded",
        checkpoint_shapes(read_args(biased)),
        config,
        state.__getitem__,
        dtype=torch.float32,
        shard_bytes=20_000,
    )
    pickled = root / "pickled"  # no safetensors: read whole, then sliced
    pickled.mkdir()
    shutil.copy(biased / "config.json", pickled)
    torch.save(state, pickled / "pytorch_model.bin")
    return {"biased": biased, "tied": tied, "sharded": sharded, "pickled": pickled}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["biased", "tied", "sharded", "pickled"])
def test_a_rank_loads_the_slices_of_the_whole_model(
    checkpoints: dict[str, Path], name: str, world: int
) -> None:
    path = checkpoints[name]
    if name == "sharded":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 3
        assert (path / "model.safetensors.index.json").is_file()
    full = load_llama(path).state_dict()
    for rank in range(world):
        shard = Shard(rank, world)
        want = shard_state(full, shard)
        model: TensorParallelLlama = load_shard(path, shard)
        got = model.state_dict()
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert got[key].dtype == torch.float32
            torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
        if rank == world - 1:  # rows past the vocabulary are zeros
            assert not got["lm_head.weight"][VOCAB - rank * len(want["lm_head.weight"]) :].any()


def test_the_dtype_and_rope_are_load_llamas(checkpoints: dict[str, Path]) -> None:
    got: TensorParallelLlama = load_shard(checkpoints["sharded"], Shard(1, 2), dtype=torch.bfloat16)
    want = shard_state(
        load_llama(checkpoints["sharded"], dtype=torch.bfloat16).state_dict(), Shard(1, 2)
    )
    for key, tensor in got.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and tensor.equal(want[key]), key
    assert got.inv_freq.equal(load_llama(checkpoints["sharded"]).inv_freq)


def _rewrite(src: Path, dst: Path, change: dict[str, torch.Tensor | None]) -> Path:
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    for key, tensor in change.items():
        if tensor is None:
            del state[key]
        else:
            state[key] = tensor
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model.layers.1.mlp.up_proj.weight": None}, r"missing \['model.layers.1.mlp.up_proj"),
        ({"model.layers.0.extra.weight": torch.zeros(2)}, r"unexpected \['model.layers.0.extra"),
        (
            {"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 60)},
            r"o_proj.weight has shape \(64, 60\), config.json implies \(64, 64\)",
        ),
        ({"model.embed_tokens.weight": None}, r"missing \['lm_head.weight', 'model.embed_tokens"),
    ],
)
def test_a_bad_checkpoint_is_refused_as_the_whole_load_refuses_it(
    checkpoints: dict[str, Path], tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    src = checkpoints["tied" if "model.embed_tokens.weight" in change else "biased"]
    path = _rewrite(src, tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=match) as whole:
        load_llama(path)
    with pytest.raises(CheckpointError, match=match) as sliced:
        load_shard(path, Shard(1, 2))
    assert str(sliced.value) == str(whole.value)


class CountingFile:
    """A `safe_open` handle that counts the elements each read returns."""

    def __init__(self, file: str, framework: str, counts: list[int]) -> None:
        self.file, self.counts = safe_open(file, framework=framework), counts

    def __enter__(self) -> CountingFile:
        self.file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.file.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.file.get_tensor(name)
        self.counts.append(tensor.numel())
        return tensor

    def get_slice(self, name: str) -> Any:
        part, counts = self.file.get_slice(name), self.counts

        class CountingSlice:
            def get_shape(self) -> list[int]:
                return list(part.get_shape())

            def __getitem__(self, index: Any) -> torch.Tensor:
                tensor = part[index]
                counts.append(tensor.numel())
                return tensor

        return CountingSlice()


@pytest.mark.parametrize("name", ["biased", "tied", "sharded"])
def test_a_rank_reads_only_its_part(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Rank 3 of 4 reads its shard's elements (the padding is not read) and no more: a quarter
    of each split tensor, the embedding and norms whole."""
    counts: list[int] = []
    monkeypatch.setattr(
        loading, "safe_open", lambda file, framework: CountingFile(file, framework, counts)
    )
    path, shard = checkpoints[name], Shard(3, 4)
    model: TensorParallelLlama = load_shard(path, shard)
    assert counts
    held = sum(t.numel() for t in model.state_dict().values())
    hidden = model.args.hidden_size
    padding = (2 * 4 - VOCAB) * hidden  # ceil(7 / 4) rows on each of 4 ranks
    assert sum(counts) == held - padding
    monkeypatch.undo()
    whole = sum(t.numel() for t in load_llama(path).state_dict().values())
    assert sum(counts) < whole / 2
