"""Typed configuration: the sections (pydantic models, relax/config/sections/), the run's config that nests
them with the checks across sections (relax/config/relax_config.py), and the loader (YAML + dotted
overrides). Import config classes from here.

Layer: config (ARCHITECTURE.md). May import the sections it nests (rewards, algorithms, data) and utils.
"""

from relax.config.loader import ConfigError, dump_config, load_config
from relax.config.relax_config import RelaxConfig, register_config_secrets
from relax.config.sections.eval import EvalConfig, EvalSetConfig
from relax.config.sections.model import ModelConfig
from relax.config.sections.ops import ClearMLConfig, OpsConfig, WandbConfig
from relax.config.sections.resources import PLACEMENT_KEYS, PlacementConfig, ResourcesConfig
from relax.config.sections.rollout import AgentConfig, ElasticConfig, RolloutConfig
from relax.config.sections.run import RunConfig
from relax.config.sections.schedule import ScheduleConfig
from relax.config.sections.trainer import LoraConfig, TrainerConfig

__all__ = [
    "PLACEMENT_KEYS",
    "AgentConfig",
    "ClearMLConfig",
    "ConfigError",
    "ElasticConfig",
    "EvalConfig",
    "EvalSetConfig",
    "LoraConfig",
    "ModelConfig",
    "OpsConfig",
    "PlacementConfig",
    "RelaxConfig",
    "ResourcesConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "TrainerConfig",
    "WandbConfig",
    "dump_config",
    "load_config",
    "register_config_secrets",
]
