"""A draft with another vocabulary or tokenizer is refused at connect, visibly, and the target
decodes without it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from specpair.models.loading import load_tokenizer, tokenizer_fingerprint
from specpair.models.tiny import make_tiny_llama
from specpair.proto.v1 import target_pb2
from tests.service.conftest import draft_config, reference_greedy, target_config

PROMPT = [5, 6, 7, 8]
INFO = target_pb2.TargetServiceGetServerInfoRequest()


def swapped_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of `src` whose tokenizer gives two tokens each other's ids (same size)."""
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


@pytest.mark.parametrize("mismatch", ["vocab_size", "tokenizer"])
async def test_incompatible_draft_is_refused_and_shown(
    ckpts: Any, make_stack: Any, tmp_path: Path, mismatch: str
) -> None:
    if mismatch == "vocab_size":
        draft = make_tiny_llama(tmp_path / "d", seed=4, vocab_size=384, num_layers=1)
        expected = "draft vocab_size 384 != target vocab_size 320"
    else:
        draft = swapped_tokenizer(ckpts["draft"], tmp_path / "d")
        expected = "draft tokenizer"
        prints = {tokenizer_fingerprint(load_tokenizer(p)) for p in (draft, ckpts["draft"])}
        assert len(prints) == 2
    stack = await make_stack(
        draft_config(draft), target_config(ckpts["target"]), wait_connected=False
    )
    deadline = time.monotonic() + 10
    while (await stack.stub.GetServerInfo(INFO)).draft_connection_state != (
        target_pb2.DRAFT_CONNECTION_STATE_INCOMPATIBLE
    ):
        assert time.monotonic() < deadline, "the draft was never refused"
        await asyncio.sleep(0.05)
    assert expected in (await stack.stub.GetServerInfo(INFO)).draft_incompatible_reason
    tokens, responses = await stack.generate(prompt_token_ids=PROMPT, max_tokens=12)
    assert tokens == reference_greedy(ckpts["target"], [PROMPT], 12)[0]
    assert not responses[-1].speculation.accept_lengths  # no speculative round ran


async def test_compatible_draft_reports_no_reason(ckpts: Any, make_stack: Any) -> None:
    stack = await make_stack(draft_config(ckpts["draft"]), target_config(ckpts["target"]))
    info = await stack.stub.GetServerInfo(INFO)
    assert info.draft_connection_state == target_pb2.DRAFT_CONNECTION_STATE_CONNECTED
    assert info.draft_incompatible_reason == ""
