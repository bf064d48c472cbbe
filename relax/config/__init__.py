"""Typed configuration: schema (pydantic models) and loader (YAML + dotted overrides).

Layer: config (ARCHITECTURE.md). May import the sections it nests (rewards, algorithms, data) and utils.
"""

from relax.config.loader import ConfigError, dump_config, load_config
from relax.config.schema import RelaxConfig

__all__ = ["ConfigError", "RelaxConfig", "dump_config", "load_config"]
