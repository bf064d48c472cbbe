"""PPO critic: a value head over a causal LM, and the clipped value loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from relax.algorithms.masked import masked_mean


class ValueHeadModel(nn.Module):
    """``backbone`` (an HF causal LM or base model) plus a linear head: last hidden state -> V(s_t).

    ``forward`` returns values [B, S], one per input position; V at position t values the state after
    token t, so the value of the state that emits response token j is at position ``prompt_len + j - 1``
    (the same shift as log-probs). The head starts at zero, so initial values are 0.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        if hidden_size is None:
            config = backbone.config
            hidden_size = getattr(config, "hidden_size", None) or config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs
        )
        hidden_BSH = out.hidden_states[-1]
        head_dtype = self.value_head.weight.dtype
        return self.value_head(hidden_BSH.to(head_dtype)).squeeze(-1)  # [B, S]


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""PPO value loss, per token [B, T]:
    :math:`\tfrac12\max\big((V - R)^2,\ (V_{old} + \mathrm{clip}(V - V_{old}, -c, c) - R)^2\big)`.

    Schulman et al. 2017 (arXiv:1707.06347) as implemented in OpenAI baselines / InstructGPT; the
    paper itself states the unclipped :math:`(V - R)^2`, which ``clip=None`` gives. ``old_values``
    and ``returns`` are detached.
    """
    old_values, returns = old_values.detach(), returns.detach()
    loss_unclipped = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * loss_unclipped
        clip_frac = torch.zeros((), device=values.device)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss_clipped = (values_clipped - returns) ** 2
        loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        clip_frac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    metrics = {
        "vf_clip_frac": clip_frac,
        "value_mean": masked_mean(values.detach(), mask),
        "value_error": masked_mean((values.detach() - returns) ** 2, mask),
    }
    return loss, metrics
