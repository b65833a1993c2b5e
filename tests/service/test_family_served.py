"""A Qwen2 checkpoint (q/k/v biases, tied embeddings) served as target and as draft LM over the
two services decodes exactly what `transformers`' generate does."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specpair.models.tiny import make_tiny_family
from tests.service.conftest import draft_config, target_config


async def test_qwen2_pair_greedy_equals_transformers(make_stack, tmp_path) -> None:
    # A seed whose greedy reply varies (tied embeddings favour repeating the last token).
    qwen2 = make_tiny_family(
        tmp_path / "qwen2",
        Qwen2Config,
        Qwen2ForCausalLM,
        seed=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM.from_pretrained(qwen2).eval()
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    expected = out[0, len(prompt) :].tolist()
    stack = await make_stack(draft_config(qwen2), target_config(qwen2))
    tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=24)
    assert tokens == expected
    assert len(set(expected)) > 4
    # The draft is the target itself: every draft is accepted, each round carries several tokens.
    assert len(responses) < len(expected) / 2
