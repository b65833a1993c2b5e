"""training/grow.py: a grown checkpoint computes what the small trained one computes.

The shipped pair is grown into mid-size shapes that exercise every part of the construction
(head_dim 40 → 128 with rotary stride 3 and a new rope theta, 32 → 64, GQA groups copied twice,
extra layers, heads, MLP units and vocabulary, a tied model untied) and compared in float32.
"""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from specpair.config import MODELS_DIR
from specpair.models.eagle3_loading import aux_layers, load_eagle3
from specpair.models.loading import load_eagle, load_llama, read_args
from specpair.models.parallel import Shard, TensorParallelLlama, load_shard, shard_state
from training.corpus import is_heldout
from training.grow import SHAPES, Growth, Shape, build_parser, grow, parse_shape

TARGET_SHAPE = Shape(512, 8, 8, 2, 128, 1024, 8448, tied=False)  # d 40 -> 128: m = 3
DRAFT_SHAPE = Shape(256, 6, 8, 2, 64, 512, 8448, tied=True)  # 5 q heads / 1 kv -> 2 kv groups


def causal_attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    # q: [B, T, Hq, D], k/v: [B, T, Hkv, D] -> [B, T, Hq, D]; the whole sequence, no cache
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture(scope="module")
def heldout_ids() -> list[list[int]]:
    """256-token windows of three stdlib files held out of the shipped models' training."""
    tokenizer = AutoTokenizer.from_pretrained(str(MODELS_DIR / "target"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    windows = []
    for path in sorted(stdlib.glob("*.py")):
        if is_heldout(f"stdlib/{path.name}") and path.stat().st_size > 4000:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
            windows.append(ids[len(ids) // 3 : len(ids) // 3 + 256])
        if len(windows) == 3:
            break
    assert len(windows) == 3
    return windows


def chain(head: torch.nn.Module, ids: Tensor, feats: Tensor, steps: int) -> list[int]:
    """Greedy drafts from the last position: the head runs on its own predictions. An EAGLE-3
    head's fc runs up front, so its rows share the width of its own outputs."""
    tokens, feats, drafted = ids[:, 1:], feats[:, :-1], []
    if feats.shape[-1] != head.args.hidden_size:
        feats = head.fc(feats)
    for _ in range(steps):
        pos = torch.arange(tokens.shape[1])[None]
        out = head(tokens, feats, pos, causal_attend)
        token = int(head.logits(out[:, -1]).argmax(-1))
        drafted.append(token)
        tokens = torch.cat((tokens, torch.tensor([[token]])), 1)
        feats = torch.cat((feats, out[:, -1:]), 1)
    return drafted


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grown")
    eagle_shape = Shape(512, 1, 8, 2, 128, 1280, 8448)
    return {
        "target": grow(MODELS_DIR / "target", root / "target", TARGET_SHAPE, dtype=torch.float32),
        "draft": grow(MODELS_DIR / "draft", root / "draft", DRAFT_SHAPE, dtype=torch.float32),
        "eagle": grow(MODELS_DIR / "eagle", root / "eagle", eagle_shape, dtype=torch.float32),
        "eagle3": grow(MODELS_DIR / "eagle3", root / "eagle3", eagle_shape, dtype=torch.float32),
    }


def hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_growth_maps_heads_and_rope_as_worked_out() -> None:
    small = read_args(MODELS_DIR / "target")
    big = replace(
        small,
        hidden_size=4096,
        head_dim=128,
        num_heads=32,
        num_kv_heads=8,
        num_layers=32,
        intermediate_size=14336,
        vocab_size=128256,
    )
    growth = Growth(small, big)
    assert growth.m == 3
    assert growth.rope_theta() == pytest.approx(10000 ** (16 / 15))
    assert growth.qk_dims[:3].tolist() == [0, 3, 6] and growth.qk_dims[20:23].tolist() == [
        64,
        67,
        70,
    ]
    # 8 q heads in 2 groups of 4 -> big groups of 4: one big group each, heads in order
    assert growth.kv_heads == [[0], [1]] and growth.q_heads == list(range(8))


@pytest.mark.parametrize(("name", "tied"), [("target", False), ("draft", True)])
def test_grown_lm_computes_the_small_models_function(
    grown: dict[str, Path], heldout_ids: list[list[int]], name: str, tied: bool
) -> None:
    small, big = hf(MODELS_DIR / name), hf(grown[name])
    config = json.loads((grown[name] / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    v = small.config.vocab_size
    with torch.no_grad():
        for ids in heldout_ids:
            tokens = torch.tensor([ids])
            a, b = small(tokens).logits[0], big(tokens).logits[0]
            assert b.shape[-1] == 8448
            # the same distribution over the real vocabulary (a tied model's logits may shift
            # by one constant per position: the embedding's constant dim)
            diff = (F.log_softmax(a, -1) - F.log_softmax(b[:, :v], -1)).abs().max().item()
            assert diff < 2e-4, diff
            if not tied:
                assert (a - b[:, :v]).abs().max().item() < 2e-4
            # padded tokens never win and hold no mass even at T = 1
            padded_mass = F.softmax(b, -1)[:, v:].sum(-1)
            assert padded_mass.max().item() < 1e-9
            assert (b[:, v:].max(-1).values < b[:, :v].max(-1).values - 50).all()
        prompt = torch.tensor([heldout_ids[0][:64]])
        out_small = small.generate(prompt, max_new_tokens=24, do_sample=False)
        out_big = big.generate(prompt, max_new_tokens=24, do_sample=False)
    assert out_small.tolist() == out_big.tolist()


def test_grown_eagle_head_drafts_what_the_small_one_drafts(
    grown: dict[str, Path], heldout_ids: list[list[int]]
) -> None:
    small_target = load_llama(MODELS_DIR / "target")
    big_target = load_llama(grown["target"])
    small_head = load_eagle(MODELS_DIR / "eagle", MODELS_DIR / "target")
    big_head = load_eagle(grown["eagle"], grown["target"])
    h, v = small_target.args.hidden_size, small_target.args.vocab_size
    growth_const = json.loads((grown["eagle"] / "config.json").read_text())["specpair_grown_from"]
    ids = torch.tensor([heldout_ids[1][:96]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        f_small = small_target(ids, positions, causal_attend)
        f_big = big_target(ids, positions, causal_attend)
        # the big features are the small ones at [0, h), the constant's image at P, zero after
        assert (f_small - f_big[..., :h]).abs().max().item() < 1e-4
        assert (f_big[..., h] > 0).all() and (f_big[..., h + 1 :] == 0).all()

        pos = torch.arange(ids.shape[1] - 1)[None]
        out_small = small_head(ids[:, 1:], f_small[:, :-1], pos, causal_attend)
        out_big = big_head(ids[:, 1:], f_big[:, :-1], pos, causal_attend)
        assert (out_small - out_big[..., :h]).abs().max().item() < 1e-4
        assert torch.allclose(out_big[..., h], torch.tensor(growth_const["constant"]))
        a, b = small_head.logits(out_small)[0], big_head.logits(out_big)[0]
        assert (a - b[:, :v]).abs().max().item() < 2e-4
        assert (b[:, v:].max(-1).values < -100).all()
        assert chain(small_head, ids, f_small, 6) == chain(big_head, ids, f_big, 6)


def test_grown_eagle3_head_drafts_what_the_small_one_drafts(
    grown: dict[str, Path], heldout_ids: list[list[int]]
) -> None:
    """The grown EAGLE-3 head reads the grown target's three layers and drafts the small
    head's tokens; its extra draft ids (a bigger reduced vocabulary) map to extra target ids
    and never win."""
    small_target = load_llama(MODELS_DIR / "target")
    big_target = load_llama(grown["target"])
    small_head = load_eagle3(MODELS_DIR / "eagle3", MODELS_DIR / "target")
    big_head = load_eagle3(grown["eagle3"], grown["target"])
    layers = aux_layers(MODELS_DIR / "eagle3", small_target.args.num_layers)
    assert aux_layers(grown["eagle3"], big_target.args.num_layers) == layers
    # extra layers come after the small ones, so the ids stay right on an 80-layer target
    assert aux_layers(grown["eagle3"], 80) == layers
    h, v = small_target.args.hidden_size, small_target.args.vocab_size
    draft_small, draft_big = len(small_head.d2t), len(big_head.d2t)
    assert draft_big == draft_small + 8448 - 8192  # as many extra draft ids as extra target ids
    assert torch.equal(big_head.target_ids()[:draft_small], small_head.target_ids())
    ids = torch.tensor([heldout_ids[2][:96]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        f_small = small_target.forward_aux(ids, positions, causal_attend, layers)[1]
        f_big = big_target.forward_aux(ids, positions, causal_attend, layers)[1]

        pos = torch.arange(ids.shape[1] - 1)[None]
        out_small = small_head(ids[:, 1:], f_small[:, :-1], pos, causal_attend)
        out_big = big_head(ids[:, 1:], f_big[:, :-1], pos, causal_attend)
        assert (out_small - out_big[..., :h]).abs().max().item() < 1e-4
        a = small_head.draft_logits(out_small)[0]
        b = big_head.draft_logits(out_big)[0]
        assert (a - b[:, :draft_small]).abs().max().item() < 2e-4
        assert (b[:, draft_small:].max(-1).values < -100).all()
        assert (big_head.logits(out_big[0])[:, v:] < -100).all()
        assert chain(small_head, ids, f_small, 6) == chain(big_head, ids, f_big, 6)


def test_growth_refuses_a_shape_too_small_naming_the_field(tmp_path: Path) -> None:
    # 2 kv groups of 4 q heads, big groups of 3: each needs 2 big groups, 4 > 3
    with pytest.raises(ValueError, match="--kv-heads 3"):
        grow(MODELS_DIR / "target", tmp_path / "x", Shape(512, 8, 9, 3, 128, 1024, 8448))
    with pytest.raises(ValueError, match="--head-dim 16"):
        grow(MODELS_DIR / "target", tmp_path / "x", Shape(512, 8, 8, 2, 16, 1024, 8448))


def test_the_70b_shape_parses_as_issue_52_writes_it() -> None:
    argv = "models/target /tmp/t70 --hidden 8192 --layers 80 --heads 64 --kv-heads 8 "
    argv += "--head-dim 128 --intermediate 28672 --vocab 128256"
    parser = build_parser()
    shape = parse_shape(parser, parser.parse_args(argv.split()))
    assert shape == Shape(8192, 80, 64, 8, 128, 28672, 128256, tied=None)
    named = parse_shape(parser, parser.parse_args(["a", "b", "--shape", "llama3-70b"]))
    assert named == SHAPES["llama3-70b"] == Shape(8192, 80, 64, 8, 128, 28672, 128256, tied=False)
    # the small target's heads land in the 70B shape (growth's refusals would name a field)
    big = Growth(
        read_args(MODELS_DIR / "target"),
        replace(
            read_args(MODELS_DIR / "target"),
            hidden_size=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
        ),
    )
    assert big.kv_heads == [[0], [1]] and big.q_heads == [0, 1, 2, 3, 8, 9, 10, 11]


def test_a_grown_checkpoint_is_written_in_bounded_files_a_rank_can_slice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Small files (64 KiB here, 2 GiB by default) with their index, one progress line each;
    load_shard reads the result as slicing the whole model would."""
    limit = 64 * 2**10
    shape = Shape(384, 8, 8, 2, 64, 768, 8448, tied=False)
    path = grow(
        MODELS_DIR / "target",
        tmp_path / "g",
        shape,
        dtype=torch.bfloat16,
        shard_bytes=limit,
        progress=print,
    )
    files = sorted(path.glob("model-*-of-*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(files) > 10 and set(index["weight_map"].values()) == {f.name for f in files}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"g/{f.name}" for f in files]
    held = Counter(index["weight_map"].values())
    for file in files:  # a file over the limit holds one tensor bigger than the limit
        assert file.stat().st_size < limit + 4096 or held[file.name] == 1, file.name
    full = load_llama(path).state_dict()
    model: TensorParallelLlama = load_shard(path, Shard(1, 2))
    for name, tensor in shard_state(full, Shard(1, 2)).items():
        assert model.state_dict()[name].equal(tensor), name
