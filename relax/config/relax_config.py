"""The typed configuration of a Relax run: `RelaxConfig` nests one pydantic model per section
(relax/config/sections/ and the data, algorithm and reward layers' own), checks what spans sections, and
still accepts keys that moved under their old names.

Every field has a one-line description (listed by `relax config --describe`). Unknown keys are errors
(`extra="forbid"`) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, model_validator

from relax.algorithms.config import AlgorithmConfig
from relax.config.sections.eval import EvalConfig
from relax.config.sections.model import ModelConfig
from relax.config.sections.ops import OpsConfig
from relax.config.sections.resources import ResourcesConfig
from relax.config.sections.rollout import RolloutConfig
from relax.config.sections.run import RunConfig
from relax.config.sections.schedule import ScheduleConfig
from relax.config.sections.trainer import TrainerConfig
from relax.data.config import DataConfig, Section
from relax.rewards.config import RewardConfig

# section.key -> new section.key: keys renamed or moved, still accepted under the old name (with a warning)
MOVED_KEYS = {
    f"resources.{key}": f"schedule.{key}"
    for key in (
        "mode",
        "max_staleness",
        "data_plane",
        "balance_data",
        "fetch_ahead",
        "overlap_push",
        "debug_train_delay_s",
        "debug_engine_step_sleep_s",
    )
}


def migrate_moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` (a raw config mapping) with keys in `MOVED_KEYS` moved to their new place; each
    moved key warns once (FutureWarning) with its new name. Both names set is an error."""
    out = dict(data)
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        new_section, new_key = new.split(".")
        target = out.get(new_section)
        target = dict(target) if isinstance(target, dict) else {}
        if new_key in target:
            raise ValueError(f"{old} and {new} are both set; {old} is the old name of {new}: keep only {new}")
        section = dict(section)
        target[new_key] = section.pop(old_key)
        out[old_section], out[new_section] = section, target
        warnings.warn(f"config key {old} is now {new}; the old name still works for now", FutureWarning, 2)
    return out


class RelaxConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Keys that moved to another section keep working under their old name, with a warning."""
        if isinstance(data, dict):
            data = migrate_moved_keys(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RelaxConfig:
        self.algorithm.validate_against(
            max_staleness=self.schedule.max_staleness, has_teacher=self.model.reference_path is not None
        )
        if self.algorithm.old_log_probs == "rollout" and self.rollout.temperature != 1.0:
            raise ValueError(
                f"algorithm.old_log_probs=rollout takes the engine's log-probs, which are after temperature "
                f"{self.rollout.temperature}, as pi_old; the trainer's are at temperature 1. Set "
                "rollout.temperature=1.0 or algorithm.old_log_probs=recompute"
            )
        if self.algorithm.spec.needs_critic and self.schedule.mode == "fully_async":
            raise ValueError(
                f"algorithm {self.algorithm.name!r} trains a critic, which runs in process on the Actor; "
                "fully_async has no critic role: use schedule.mode=hybrid (streaming) or colocate"
            )
        if self.rollout.over_provision and (
            self.rollout.batch_order != "completion" or self.schedule.mode == "colocate"
        ):
            raise ValueError(
                f"rollout.over_provision={self.rollout.over_provision} sends surplus groups to later steps: it "
                "needs rollout.batch_order=completion and schedule.mode hybrid or fully_async (colocate "
                "generates each step on request); set those, or rollout.over_provision=0"
            )
        if self.schedule.overlap_push and self.trainer.uses_group:
            raise ValueError(
                "schedule.overlap_push=true needs the in-process trainer: the fsdp ranks publish their live "
                "shards, which the next update would change mid-push; leave schedule.overlap_push unset"
            )
        if self.trainer.weight_sync_backend == "disk" and self.trainer.lora is not None:
            raise ValueError(
                "trainer.weight_sync_backend=disk writes full weights; LoRA runs publish adapters or merged "
                "modules through the broadcast group: leave trainer.weight_sync_backend=auto"
            )
        if self.algorithm.spec.needs_complete_groups and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} normalises rewards within prompt groups and needs "
                "rollout.n_samples_per_prompt >= 2 (8 is typical)"
            )
        return self


def register_config_secrets(cfg: RelaxConfig) -> None:
    """Mask this config's credentials and the run's token in everything this process logs."""
    from relax.utils.redact import register_secret, secret_values

    for value in secret_values(cfg.model_dump(mode="json")):
        register_secret(value)
    register_secret(cfg.run.token_value())
