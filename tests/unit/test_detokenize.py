"""Incremental detokenization and stop strings."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from target_service.request_path.detokenize import TextStream

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


def test_deltas_do_not_depend_on_rounds_even_for_broken_bytes(ckpts: dict[str, Path]) -> None:
    """A random tiny model emits byte tokens that are no UTF-8: whatever the rounds' sizes,
    the streamed text adds up to the whole decode (split characters shown once settled, the
    rest flushed by the last round). Without the flush a stream ending inside a split character
    loses its tail, and gRPC and HTTP streams of one generation differ."""
    import random

    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(1, tok.vocab_size) for _ in range(30)]
        full = tok.decode(ids, skip_special_tokens=True)
        for stop in ((), ("\x00never",)):
            stream, text, i = TextStream(tok, stop), "", 0
            while i < len(ids):
                n = rng.randint(1, 8)
                text += stream.push(ids[i : i + n], final=i + n >= len(ids))[1]
                i += n
            assert text == full, (ids, stop)


def test_a_split_character_waits_for_its_last_byte(ckpts: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(ckpts["target"])
    ids = tok.encode("a€b")  # "€" is E2 82 AC: byte tokens of the tiny byte-level BPE
    stream = TextStream(tok)
    deltas = [stream.push([t])[1] for t in ids]
    assert "".join(deltas) == "a€b"
    assert "\ufffd" not in "".join(deltas)
