"""Configuration of the reward layer: which reward scores a row, with what arguments and limits."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.rewards.genrm import GenRMConfig
from relax.rewards.registry import REWARDS, check_kwargs, resolve_reward


class RewardConfig(BaseModel):
    """How samples are scored. Reward names are checked here, so a typo fails before training starts."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "math",
        description="Default reward: a built-in name (math, multiple_choice, exact_match, first_number, "
        "f1, format_think_answer, dapo, remote, genrm) or an import path 'package.module:function' whose "
        "contract is in relax/rewards/registry.py. Used for rows that do not select a reward themselves.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the default reward `name` (e.g. {'url': ...} for "
        "remote, {'max_response_length': 4096, 'overlong_buffer_len': 512} for dapo).",
    )
    type_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Keyword arguments for rewards selected per row, keyed by reward name or import "
        "path; for the default reward they are merged over `kwargs`. Other rewards get no arguments.",
    )
    strip_reasoning: bool = Field(
        True,
        description="Built-in rewards that score an answer (math, multiple_choice, exact_match, "
        "first_number, f1, dapo, genrm) score the text after a reasoning model's <think>...</think> block "
        "(or after </think> alone, as DeepSeek-R1 writes it); a block that never closes has no answer. "
        "False: the whole response. A `strip_reasoning` in kwargs/type_kwargs wins for that reward.",
    )
    reward_key: str = Field(
        "reward",
        description="For a user reward that returns a dict: the key holding the reward (the other "
        "numeric entries are logged as metrics). Built-in rewards always use 'reward'.",
    )
    per_row_key: str | None = Field(
        "rm_type",
        description="Key of a row's `metadata` naming the reward for that row (a name or import path); "
        "rows without it use `name`. None: every row uses `name`.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds one reward call (one sample, or one group for group rewards) may take; a "
        "call past it gets `fallback_reward`. A timed-out sync function keeps its worker thread busy "
        "until it returns.",
    )
    fallback_reward: float = Field(
        0.0, description="Reward given to a sample whose reward function raised or timed out."
    )
    max_concurrency: int = Field(
        32,
        ge=1,
        description="Most reward calls in flight at once per scorer (also the size of the thread pool "
        "that runs sync reward functions); with `num_workers` > 0 the limit is for the whole pool.",
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="Reward worker processes (Ray actors) that score off the rollout's critical path; "
        "0: score in the rollout process.",
    )
    worker_cpus: float = Field(0.25, gt=0, description="Logical Ray CPUs reserved per reward worker.")
    genrm: GenRMConfig | None = Field(
        None,
        description="The GenRM (LLM-as-judge) service; set it to deploy the `genrm` role and use the "
        "`genrm` reward (relax/rewards/genrm.py).",
    )

    @field_validator("name")
    @classmethod
    def _name_resolves(cls, name: str) -> str:
        resolve_reward(name)  # raises ValueError listing the built-in names or the import failure
        return name

    @field_validator("type_kwargs")
    @classmethod
    def _types_resolve(cls, type_kwargs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for rm_type in type_kwargs:
            resolve_reward(rm_type)
        return type_kwargs

    @model_validator(mode="after")
    def _kwargs_fit(self) -> RewardConfig:
        check_kwargs(resolve_reward(self.name), self.kwargs_for(self.name))
        for rm_type in self.type_kwargs:
            check_kwargs(resolve_reward(rm_type), self.kwargs_for(rm_type))
        if self.genrm is None and "genrm" in {self.name, *self.type_kwargs}:
            raise ValueError(
                "the genrm reward needs the GenRM service: set reward.genrm.model_path=<judge checkpoint>"
            )
        return self

    def kwargs_for(self, rm_type: str) -> dict[str, Any]:
        """Keyword arguments for the reward ``rm_type``: ``kwargs`` for the default reward, merged with
        ``type_kwargs[rm_type]``; ``strip_reasoning=False`` first for a built-in that scores an answer
        when ``strip_reasoning`` is off."""
        base = dict(self.kwargs) if rm_type == self.name else {}
        if not self.strip_reasoning and rm_type in REWARDS and REWARDS[rm_type].strips_reasoning:
            base = {"strip_reasoning": False, **base}  # true is the built-ins' own default
        return {**base, **self.type_kwargs.get(rm_type, {})}
