"""Incremental detokenization with stop strings: text deltas that never split a character."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns generated token ids into text deltas; finds stop strings across rounds.

    Each step decodes only a short window: the ids since the previous step plus the chunk
    before them as context (what a tokenizer's spacing rules need), so a request costs
    O(tokens) to detokenize, not O(tokens²).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context chunk, already turned into text
        self.read = 0
        self.committed = ""  # text up to the clean boundary `read`
        self.text = ""  # all text shown so far: committed + the settled part after it
        self.streamed = 0  # characters of it already returned as deltas

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _advance(self, final: bool = False) -> None:
        """Brings `text` up to the ids so far. Text since the last clean boundary (`read`) is
        shown up to a trailing run of U+FFFD — the bytes of a character still being split,
        which the next ids may complete — and committed once it ends cleanly (or `final`).

        Bytes E2 82 | AC (two rounds): "…\ufffd" shows "…" and waits; then "…€" commits."""
        if self.tokenizer is None:
            return
        context = self._decode(self.ids[self.prefix : self.read])
        tail = self._decode(self.ids[self.prefix :])[len(context) :]
        if final or not tail.endswith("\ufffd"):
            self.committed += tail
            self.text = self.committed
            self.prefix, self.read = self.read, len(self.ids)
        else:
            self.text = self.committed + tail.rstrip("\ufffd")

    def push(self, token_ids: list[int], final: bool = False) -> tuple[list[int], str, bool]:
        """Adds a round's tokens (`final`: the request's last). Returns (tokens kept, text
        delta, stop string hit).

        On a stop hit the tokens are cut after the one that completed the stop string and
        the text is cut before the stop string (as OpenAI-style APIs do).
        """
        kept: list[int] = []
        for n, token in enumerate(token_ids, 1):
            kept.append(token)
            self.ids.append(token)
            if not self.stop:
                continue
            before = len(self.text)
            # per token: the cut goes after the token that completes a stop
            self._advance(final and n == len(token_ids))
            start = max(0, before - self.longest_stop + 1)  # only new text can complete one
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return kept, self._delta(), True
        if not self.stop or (final and not token_ids):
            self._advance(final)
        return kept, self._delta(), False

    def _delta(self) -> str:
        delta = self.text[self.streamed :]
        self.streamed = max(self.streamed, len(self.text))
        return delta
