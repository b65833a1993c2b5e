"""Token maps (`models/draft_vocab.py`): the file a user brings is read exactly or refused with
its path named, and an EAGLE-1 head given one drafts over those ids only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specpair.config import DraftConfig, ServerConfig
from specpair.models import draft_vocab, token_map
from specpair.models.loading import CheckpointError, load_eagle
from specpair.models.tiny import make_tiny_eagle, make_tiny_eagle3, make_tiny_llama
from specpair.models.token_map import load_token_map
from specpair.runtime.build import build_drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("draft_vocab")
    target = make_tiny_llama(root / "target", seed=1, num_layers=2)
    return target, make_tiny_eagle(root / "eagle", target, seed=2)


def test_pt_and_json_maps_read_as_sorted_ids(tmp_path: Path) -> None:
    torch.save(torch.tensor([7, 1, 4]), tmp_path / "map.pt")  # SGLang's: frequency order
    (tmp_path / "map.json").write_text("[7, 1, 4]")
    torch.save([7, 1, 4], tmp_path / "list.pt")
    for name in ("map.pt", "map.json", "list.pt"):
        assert load_token_map(tmp_path / name, 8).tolist() == [1, 4, 7]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2, 99]", r"token id 99 outside the target's vocabulary \[0, 10\)"),
        ("[-1, 2]", "token id -1 outside"),
        ("[1, 2, 1]", "a token id appears twice"),
        ("[]", "non-empty 1-D list of integer ids"),
        ("[[1, 2]]", "non-empty 1-D list of integer ids"),
        ("[1.5, 2]", "non-empty 1-D list of integer ids"),
        ('{"ids": [1]}', "not a token map"),
        ("[1, 2", "not a token map"),
    ],
)
def test_a_bad_map_is_refused_naming_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(CheckpointError, match=message) as err:
        load_token_map(path, 10)
    assert str(path) in str(err.value)


def test_a_missing_or_foreign_map_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such token map"):
        load_token_map(tmp_path / "absent.pt", 10)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"junk\.pt: not a token map"):
        load_token_map(tmp_path / "junk.pt", 10)


def test_frequency_map_keeps_the_most_frequent_ids_ties_by_id() -> None:
    counts = torch.tensor([5, 0, 9, 5, 0, 1])
    assert draft_vocab.frequency_map(counts, 3).tolist() == [0, 2, 3]
    # unseen ids come last, lowest first
    assert draft_vocab.frequency_map(counts, 5).tolist() == [0, 1, 2, 3, 5]
    with pytest.raises(ValueError, match="size must be in"):
        draft_vocab.frequency_map(counts, 7)


def test_a_mapped_head_drafts_over_the_maps_ids_only(pair, tmp_path: Path) -> None:
    target, head_dir = pair
    full = load_eagle(head_dir, target)
    ids = torch.randperm(full.args.vocab_size, generator=torch.Generator().manual_seed(0))[:50]
    (tmp_path / "map.json").write_text(json.dumps(ids.tolist()))
    head = load_eagle(head_dir, target, token_map=load_token_map(tmp_path / "map.json", 10**6))
    assert head.lm_head.weight.shape == (50, full.args.hidden_size)
    hidden = torch.randn(4, 3, full.args.hidden_size)
    logits, ref = head.logits(hidden), full.logits(hidden)
    mapped = ids.sort().values
    assert torch.equal(logits[..., mapped], ref[..., mapped])  # the target's rows, unchanged
    off = torch.ones(full.args.vocab_size, dtype=torch.bool)
    off[mapped] = False
    assert torch.isneginf(logits[..., off]).all()
    assert torch.equal(head.greedy(hidden), ref.masked_fill(off, float("-inf")).argmax(-1))
    assert not torch.equal(full.greedy(hidden), head.greedy(hidden))  # the map did something


def test_a_map_is_refused_for_drafts_it_does_not_apply_to(pair, tmp_path: Path) -> None:
    target, _ = pair
    (tmp_path / "map.json").write_text("[1, 2, 3]")
    head3 = make_tiny_eagle3(tmp_path / "eagle3", target, seed=3, draft_vocab=8, layers=[0, 1, 1])
    sizes = dict(max_requests=1, max_len=32, token_map=tmp_path / "map.json")
    with pytest.raises(CheckpointError, match="an EAGLE-3 head drafts over its own d2t"):
        build_drafter(head3, target_path=target, **sizes)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"token_map: .*EAGLE-1/2 head .*not a draft LM"):
        build_drafter(target, target_path=None, **sizes)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_map: a token map applies to an EAGLE-1/2 head"):
        DraftConfig(
            server=ServerConfig("127.0.0.1:0"), model_path=target, token_map=sizes["token_map"]
        )


def test_the_command_writes_a_map_of_the_most_frequent_ids(pair, tmp_path: Path, capsys) -> None:
    target, _ = pair
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    out = tmp_path / "map.pt"
    assert (
        token_map.main(["--tokenizer", str(target), "--size", "16", "--out", str(out), str(text)])
        == 0
    )
    ids = load_token_map(out, 10**6)
    assert len(ids) == 16
    from specpair.models.loading import load_tokenizer

    seen = set(load_tokenizer(target)(text.read_text(), add_special_tokens=False)["input_ids"])
    assert 0 < len(seen) < 16 and seen <= set(ids.tolist())  # the counted ids come first
    assert "16 ids covering" in capsys.readouterr().out


def test_serve_draft_takes_a_map_and_up_passes_it() -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "draft", "--model", "m", "--token-map", "map.pt"])
    assert args.token_map == Path("map.pt")
    up = parser.parse_args(["up", "--draft-kind", "eagle", "--draft-token-map", "map.pt"])
    draft = next(s.args for s in up_services(up)[0] if s.name == "draft")
    assert draft[draft.index("--token-map") + 1] == "map.pt"
    plain = next(s.args for s in up_services(parser.parse_args(["up"]))[0] if s.name == "draft")
    assert "--token-map" not in plain
