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


class CountingTokenizer:
    """Wraps a tokenizer; counts the ids it was asked to decode."""

    def __init__(self, tok: object) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decoded += len(ids)
        return str(self.tok.decode(ids, **kwargs))  # type: ignore[attr-defined]


def test_long_streams_decode_each_token_a_bounded_number_of_times(ckpts: dict[str, Path]) -> None:
    tok = CountingTokenizer(AutoTokenizer.from_pretrained(ckpts["target"]))
    text = TEXT * 40 + "é ü ñ"
    ids = tok.tok.encode(text)  # type: ignore[attr-defined]
    for size, stop in ((1, ()), (5, ()), (3, ("never seen",))):
        tok.decoded = 0
        stream = TextStream(tok, stop=stop)
        assert "".join(stream.push(c)[1] for c in chunks(ids, size)) == text
        # Windows, not the whole history: whole-history decoding would be ~len(ids)² / 2.
        assert tok.decoded < 8 * len(ids)
