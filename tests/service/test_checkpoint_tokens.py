"""The checkpoint's special tokens over the service: generation_config's eos list stops a
generation, and a text prompt starts with BOS where the tokenizer config says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from specpair.proto.v1 import target_pb2
from tests.service.conftest import target_config


async def test_eos_list_stops_and_bos_starts_the_prompt(ckpts, make_stack, tmp_path) -> None:
    plain = await make_stack(None, target_config(ckpts["target"]))
    prompt = [5, 6, 7]
    ref, _ = await plain.generate(prompt_token_ids=prompt, max_tokens=24)
    # The first token of the reply that is new at its position is made an extra eos (Llama-3.1
    # lists three): the reply must end right there, as `transformers`' generate would.
    k = next(i for i, t in enumerate(ref) if i > 2 and t not in ref[:i] and t != 0)
    assert k + 1 < len(ref)
    path = Path(shutil.copytree(ckpts["target"], tmp_path / "target"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, ref[k]]}))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "add_bos_token": True}))
    stack = await make_stack(None, target_config(path))
    tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=24)
    assert tokens == ref[: k + 1]
    assert responses[-1].finish_reason == target_pb2.FINISH_REASON_STOP
    _, responses = await stack.generate(prompt="def main(argv):", max_tokens=2)
    bare = AutoTokenizer.from_pretrained(path).encode("def main(argv):", add_special_tokens=False)
    assert responses[-1].usage.prompt_tokens == len(bare) + 1
