"""A Qwen2 checkpoint (q/k/v biases, tied embeddings) served as target and as draft LM over the
two services decodes exactly what `transformers`' generate does."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.service.conftest import draft_config, target_config


async def test_qwen2_pair_greedy_equals_transformers(make_stack, tmp_path) -> None:
    config = Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(3)  # a seed whose greedy reply varies (tied embeddings favour repeats)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # nonzero biases, or the test would not tell them apart from none
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "qwen2")
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    expected = out[0, len(prompt) :].tolist()
    qwen2 = tmp_path / "qwen2"
    stack = await make_stack(draft_config(qwen2), target_config(qwen2))
    tokens, responses = await stack.generate(prompt_token_ids=prompt, max_tokens=24)
    assert tokens == expected
    assert len(set(expected)) > 4
    # The draft is the target itself: every draft is accepted, each round carries several tokens.
    assert len(responses) < len(expected) / 2
