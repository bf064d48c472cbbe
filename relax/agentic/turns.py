"""Chat turns as tokens: the prompt (with the environment's tools listed) and the tokens of environment
turns appended after a model turn, exactly as the model's chat template writes them.

Token-in, token-out: the model's tokens are never decoded and re-encoded; only the environment's
messages are encoded, once, and appended. For Qwen's template an observation after a model turn that
ended with `<|im_end|>` is::

    \\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

The text comes from the template itself (the rendering of a conversation with and without the
messages, differenced), so another model family's template gives its own format. A turn that stopped at
`</tool_call>` (not at the end-of-turn token) gets the end-of-turn token first, as an environment token.

Images in an observation (a VLM's tool showing a picture) become `<|vision_start|><|image_pad|>*N
<|vision_end|>` in the text and pixel tensors that are appended to the sample's media
(`relax.data.multimodal`).
"""

from __future__ import annotations

from typing import Any

import torch

from relax.agentic.env import Message
from relax.data.dataset import tokenize_prompt

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TurnFormatter:
    def __init__(
        self, tokenizer: Any, model_path: str | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        # the template's own variables (data.chat_template_kwargs): prompts and the assistant turns opened
        # after observations are rendered alike
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_text = "<|im_end|>"
        self.eos_id = tokenizer.convert_tokens_to_ids(self.eos_text)
        if self.eos_id is None or self.eos_id == tokenizer.unk_token_id:
            self.eos_text, self.eos_id = tokenizer.eos_token, tokenizer.eos_token_id
        self._mm: Any = None  # MultimodalProcessor, loaded by the first image

    def prompt_ids(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt's tokens, the tools listed in the system turn when `tools` is given."""
        if not tools or not apply_chat_template:
            return tokenize_prompt(
                self.tokenizer, prompt, apply_chat_template, system_prompt, self.template_kwargs
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def messages_text(self, messages: list[dict[str, Any]]) -> str:
        """The text the template writes for `messages` after an assistant turn that ended with the
        end-of-turn token, through the opening of the next assistant turn."""
        render = self.tokenizer.apply_chat_template
        base = render(_BASE, tokenize=False, **self.template_kwargs)
        full = render(
            _BASE + list(messages), tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        if not full.startswith(base) or self.eos_text not in base:
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation; "
                "environment turns cannot be appended token-in/token-out with it"
            )
        separator = base[base.rindex(self.eos_text) + len(self.eos_text) :]  # e.g. "\n"
        return separator + full[len(base) :]

    def observation(
        self, messages: list[Message], turn_ended: bool
    ) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """Tokens of environment `messages` after a model turn, and the media tensors of their images.
        `turn_ended`: the model's turn ended with the end-of-turn token (else it is added here)."""
        chat = []
        images: list[Any] = []
        for m in messages:
            content = m.content
            if m.images:
                content = content + "<image>" * len(m.images)
                images += m.images
            chat.append({"role": m.role, "content": content})
        media = None
        if images:
            chat, media, counts = self._with_images(chat, images)
        text = self.messages_text(chat)
        if images:
            pad = self._mm.tokens["image"][1]
            text = self._mm._expand(text, pad, counts)
        if not turn_ended:
            text = self.eos_text + text
        return list(self.tokenizer.encode(text, add_special_tokens=False)), media

    def _with_images(
        self, chat: list[dict[str, Any]], images: list[Any]
    ) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], list[int]]:
        from relax.data.media import load_image
        from relax.data.multimodal import _PLACEHOLDER_RE, MultimodalProcessor

        if self._mm is None:
            if self.model_path is None:
                raise ValueError("an observation with images needs a multimodal model (model_path)")
            self._mm = MultimodalProcessor(self.model_path)
        if "image" not in self._mm.tokens or self._mm.tokens["image"][1] is None:
            raise ValueError(f"model type {self._mm.model_type!r} takes no images; the tool returned one")
        start, pad, end = self._mm.tokens["image"]
        pil = [img if hasattr(img, "convert") else load_image(str(img), "tool image") for img in images]
        out = self._mm.image_processor(images=[p.convert("RGB") for p in pil], return_tensors="pt")
        merge2 = self._mm.image_processor.merge_size**2
        counts = [int(g.prod()) // merge2 for g in out["image_grid_thw"]]
        chat = [{**m, "content": _PLACEHOLDER_RE.sub(start + pad + end, m["content"])} for m in chat]
        return chat, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, counts


def merge_media(
    old: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """A sample's media after more images: per-image tensors concatenated in order of appearance."""
    if not new:
        return old
    if not old:
        return dict(new)
    out = dict(old)
    for key, value in new.items():
        out[key] = torch.cat([old[key], value], dim=0) if key in old else value
    return out
