"""Incremental detokenization with stop strings: text deltas that never split a character."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns generated token ids into text deltas; finds stop strings across rounds."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = ""  # text already streamed

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_ids: list[int]) -> tuple[list[int], str, bool]:
        """Adds a round's tokens. Returns (tokens kept, text delta, stop string hit).

        On a stop hit the tokens are cut after the one that completed the stop string and
        the text is cut before the stop string (as OpenAI-style APIs do).
        """
        kept: list[int] = []
        for token in token_ids:
            kept.append(token)
            if self.stop:
                text = self._decode(self.ids + kept)
                # Only the tail can hold a new match: the sent text had none.
                window = max(0, len(self.sent) - max(len(s) for s in self.stop))
                hits = [i for s in self.stop if (i := text.find(s, window)) >= 0]
                if hits:
                    self.ids += kept
                    delta = text[: min(hits)][len(self.sent) :]
                    self.sent += delta
                    return kept, delta, True
        self.ids += kept
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return kept, "", False
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return kept, delta, False
