"""Incremental detokenization and stop strings."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from target_service.detokenize import TextStream

TEXT = "def main(argv):\n    return 0\n\nclass Config:\n    name: str = 'specpair'\n"


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_deltas_add_up_to_the_text(ckpts: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    ids = tok.encode(TEXT)
    stream = TextStream(tok)
    pieces = [stream.push(c)[1] for c in chunks(ids, 3)]
    assert "".join(pieces) == TEXT


def test_stop_string_cuts_text_and_tokens(ckpts: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    ids = tok.encode(TEXT)
    stream = TextStream(tok, stop=("class",))
    text, kept_ids, hit = "", [], False
    for chunk in chunks(ids, 4):
        kept, delta, hit = stream.push(chunk)
        text += delta
        kept_ids += kept
        if hit:
            break
    assert hit
    assert text == TEXT[: TEXT.index("class")]
    assert "class" in tok.decode(kept_ids) and "class" not in tok.decode(kept_ids[:-1])


def test_incomplete_utf8_is_held_back(ckpts: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    ids = tok.encode("é ü")  # multi-byte characters split across byte-level tokens
    stream = TextStream(tok)
    pieces = [stream.push([i])[1] for i in ids]
    assert "".join(pieces) == "é ü"
    assert all("\ufffd" not in p for p in pieces)
