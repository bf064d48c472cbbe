"""A chat template with Qwen3's switches, for tests of reasoning models: the tiny model's Qwen2.5 template
where `enable_thinking: false` writes an empty think block into the opened assistant turn (as Qwen3's
template does) and a `reasoning_effort` is written out after it."""

from __future__ import annotations

from relax.models.tokenizer import QWEN25_CHAT_TEMPLATE

_OPEN = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
assert _OPEN in QWEN25_CHAT_TEMPLATE
THINKING_TEMPLATE = QWEN25_CHAT_TEMPLATE.replace(
    _OPEN,
    _OPEN
    + "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    + "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    + "    {%- endif %}\n"
    + "    {%- if reasoning_effort is defined %}{{- 'effort: ' + reasoning_effort + '\\n' }}{%- endif %}\n",
)
EMPTY_BLOCK = "<think>\n\n</think>\n\n"  # what enable_thinking: false adds
