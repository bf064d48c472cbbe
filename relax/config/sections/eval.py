"""The `eval` section: held-out sets, each with its own data, reward and sampling, and when they run."""

from __future__ import annotations

from pydantic import Field, model_validator

from relax.data.config import Section
from relax.rewards.config import RewardConfig


class EvalSetConfig(Section):
    """One held-out set: its own data, reward and sampling settings."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Set name; metrics go to eval/<name>/.")
    files: list[str] = Field(
        ...,
        min_length=1,
        description="Prompt files (.jsonl or .parquet), or Hub data sets `hf://datasets/<org>/<name>?config="
        "<config>&split=<split>` as in data.train_files (split default test).",
    )
    reward: RewardConfig | None = Field(None, description="Reward for this set (None = the training reward).")
    n_samples_per_prompt: int = Field(1, gt=0, description="Samples per prompt (n of pass@k).")
    k_values: list[int] = Field(default_factory=lambda: [1], description="k values for pass@k and mean@k.")
    max_new_tokens: int | None = Field(
        None, gt=0, description="Response cap (None = rollout.max_new_tokens)."
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_prompts: int | None = Field(None, gt=0, description="Evaluate only the first N prompts.")
    correct_threshold: float = Field(
        0.5, description="A sample counts as correct for pass@k if reward >= this."
    )
    save_samples: int = Field(64, ge=0, description="Responses (with scores) saved per evaluation as JSONL.")

    @model_validator(mode="after")
    def _k_fits(self) -> EvalSetConfig:
        bad = [k for k in self.k_values if not 1 <= k <= self.n_samples_per_prompt]
        if bad:
            raise ValueError(
                f"eval set {self.name!r}: k_values {bad} must be between 1 and n_samples_per_prompt="
                f"{self.n_samples_per_prompt}; raise n_samples_per_prompt or drop those k"
            )
        return self


class EvalConfig(Section):
    sets: list[EvalSetConfig] = Field(default_factory=list, description="Held-out sets (empty = no eval).")
    interval: int = Field(0, ge=0, description="Evaluate every N training steps (0 = never during training).")
    before_train: bool = Field(False, description="Evaluate once before the first step.")
    at_end: bool = Field(True, description="Evaluate after the last step.")

    @model_validator(mode="after")
    def _unique_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets names must be unique, got {names}")
        return self
