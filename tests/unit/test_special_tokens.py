"""eos ids and BOS read from a checkpoint as `transformers` reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from specpair.models.loading import CheckpointError
from specpair.models.tiny import write_tokenizer
from target_service.request_path.request import ClientRequest
from target_service.request_path.special_tokens import eos_ids, prompt_bos
from target_service.request_path.validation import validate_generate

BOS = "<|begin_of_text|>"


def checkpoint(path: Path, **config: object) -> Path:
    path.mkdir()
    write_tokenizer(path, 320)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0, **config}))
    return path


def test_generation_config_eos_list(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(path)
    assert eos_ids(path, tok) == {0}  # config.json's and the tokenizer's
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 11]}))
    assert eos_ids(path, tok) == {0, 7, 9, 11}
    assert eos_ids(path, None) == {7, 9, 11}
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        eos_ids(path, tok)


def test_bos_as_the_tokenizer_config_says(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "m")
    assert prompt_bos(path, AutoTokenizer.from_pretrained(path)) is None  # adds nothing
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = AutoTokenizer.from_pretrained(path)
    assert prompt_bos(path, tok) == tok.bos_token_id == 0


def test_bos_of_a_post_processor_matches_transformers(tmp_path: Path) -> None:
    """Llama-3's tokenizer.json prepends <|begin_of_text|> itself; no add_bos_token key."""
    path = checkpoint(tmp_path / "m")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    raw.add_special_tokens([BOS])
    bos = raw.token_to_id(BOS)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    raw.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": BOS}))
    tok = AutoTokenizer.from_pretrained(path)
    assert prompt_bos(path, tok) == bos
    text = "The quick brown fox"
    valid = validate_generate(
        ClientRequest(prompt=text, max_tokens=4),
        tokenizer=tok,
        vocab_size=len(tok),
        max_len=64,
        bos=prompt_bos(path, tok),
    )
    assert valid.prompt_ids == tok(text).input_ids
    assert valid.prompt_ids[0] == bos and valid.prompt_ids.count(bos) == 1
