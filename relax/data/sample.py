"""What one trajectory is, as it travels from the data set through rollout to the trainer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.data.dataset import PromptRow


class SampleStatus(str, enum.Enum):
    PENDING = "pending"  # not generated yet
    COMPLETED = "completed"  # the engine stopped on EOS or a stop string/id
    TRUNCATED = "truncated"  # the engine stopped at max_new_tokens
    ABORTED = "aborted"  # generation was aborted (weight update, shutdown)
    FAILED = "failed"  # the engine or the reward failed for this sample


@dataclass
class Sample:
    """One prompt's one response. Filled in stages: data set -> Rollout -> reward -> Advantages -> trainer."""

    # -- from the data set --
    index: int  # global prompt index in the data stream (stable across resume)
    prompt: str | list[dict[str, Any]]  # raw prompt: text, or chat messages
    label: Any = None  # reference answer handed to the reward function
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form row metadata (e.g. rm_type)
    prompt_ids: list[int] = field(default_factory=list)  # prompt tokens after the chat template, [P]
    # Media tensors of a multimodal prompt, keyed by the model's forward kwarg names (pixel_values,
    # image_grid_thw, input_features, ...; see relax.data.multimodal). Filled by Rollout from the data
    # set's processor; the same tensors go to the engine's prefill and the trainer's forward. None = text.
    multimodal_inputs: dict[str, Any] | None = None
    # -- grouping --
    group_id: int = 0  # samples of one prompt share a group id (GRPO groups)
    sample_id: int = 0  # position within the group, 0..n_samples_per_prompt-1
    # -- from Rollout --
    response_ids: list[int] = field(default_factory=list)  # generated tokens, [R]
    response_text: str = ""  # decoded response (special tokens skipped)
    loss_mask: list[int] = field(default_factory=list)  # 1 = model token trained on, 0 = env token, [R]
    rollout_log_probs: list[float] = field(default_factory=list)  # behaviour log-probs from the engine, [R]
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[int] = field(default_factory=list)  # weight version(s) the tokens came from
    # -- from agentic rollouts (relax.agentic; empty for single-turn samples) --
    # One record per model turn: its token span in response_ids ("start", "end"), the environment tokens
    # after it ("obs_start", "obs_end"), its text, tool calls and their results.
    turns: list[dict[str, Any]] = field(default_factory=list)
    termination: str = ""  # why the episode ended: env_done | max_turns | token_budget | turn_truncated | ...
    contexts: list[Sample] = field(default_factory=list)  # multi-agent: further contexts, one row each
    # -- from the reward --
    reward: float | None = None  # scalar reward used by the algorithm
    reward_info: dict[str, float] = field(default_factory=dict)  # extra reward metrics (logged, not trained)

    @classmethod
    def from_row(cls, row: PromptRow, group_id: int, sample_id: int, **fields: Any) -> Sample:
        """Sample `sample_id` of prompt group `group_id` drawn from data row `row` (its index, prompt, label
        and a copy of its metadata); `fields` fill the rest (prompt_ids, response_ids, ...)."""
        return cls(
            index=row.index,
            prompt=row.prompt,
            label=row.label,
            metadata=dict(row.metadata),
            group_id=group_id,
            sample_id=sample_id,
            **fields,
        )

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by response, [P + R]."""
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def weight_version(self) -> int:
        """The oldest weight version that produced any token of this sample (-1 if not generated)."""
        return min(self.weight_versions) if self.weight_versions else -1
