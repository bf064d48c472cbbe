"""Variables a chat template reads beyond the messages: Hugging Face's `chat_template_kwargs`, such as
Qwen3's `enable_thinking` (false: the template writes an empty `<think></think>` block into the opened
assistant turn, so the model answers without reasoning) or a `reasoning_effort`. Training prompts get them
from `data.chat_template_kwargs`; `/v1/chat/completions` from the request's own `chat_template_kwargs`.
A template ignores the variables it does not read, so an unknown name is not an error; a name that
`apply_chat_template` takes itself is (it would change the rendering behind the config's back).
"""

from __future__ import annotations

from typing import Any

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "chat_template",
})  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """`kwargs` (None: none), or `ValueError` naming the reserved names it sets and the `key` it came from."""
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"{key} may not set {', '.join(reserved)}: apply_chat_template takes those itself "
            "(template variables such as enable_thinking belong here)"
        )
    return kwargs
