"""Chat: a conversation rendered into prompt token ids with the checkpoint's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from target_service.request_path.request import ChatTurn

# OpenAI's roles that a chat without tool calling has, each as the template is given it: a
# `developer` message is OpenAI's newer name for a `system` one, which templates know.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def check_role(role: str, name: str) -> None:
    """A role this server serves, or ValueError naming the field and the role (as OpenAI
    refuses `"wizard"`): a template would render an unknown role as text, or fail inside."""
    if role in ROLES:
        return
    why = " (this server has no tool calling)" if role in ("tool", "function") else ""
    raise ValueError(f"{name}: role {role!r} is not one of {', '.join(ROLES)}{why}")


def chat_prompt_ids(messages: Sequence[ChatTurn], tokenizer: Any) -> list[int]:
    """The template's text for `messages` plus the generation prompt, as token ids.

    Raises ValueError naming the field. The text is encoded without special tokens: a template
    writes its own (e.g. a bos), as `transformers`' `apply_chat_template(tokenize=True)` does.
    """
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer; send prompt_token_ids")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "messages: this model's checkpoint has no chat template (chat_template.jinja, or "
            "chat_template in tokenizer_config.json); send a prompt instead"
        )
    for i, message in enumerate(messages):
        check_role(message.role, f"messages[{i}].role")
    conversation = [{"role": ROLES[m.role], "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:  # e.g. a template's raise_exception("roles must alternate")
        raise ValueError(f"messages: the chat template refused them: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
