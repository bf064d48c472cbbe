"""Typed configuration: schema (pydantic models) and loader (YAML + dotted overrides)."""

from relax.config.loader import ConfigError, dump_config, load_config
from relax.config.schema import RelaxConfig

__all__ = ["ConfigError", "RelaxConfig", "dump_config", "load_config"]
