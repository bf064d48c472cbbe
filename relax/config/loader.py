"""Load a YAML config, apply dotted command-line overrides, validate, and explain what is wrong.

    relax train run.yaml algorithm.name=grpo rollout.n_samples_per_prompt=8

An override's value is parsed as YAML (`8` is an int, `[a, b]` a list, `null` None). Errors name the key,
the accepted values or keys, and a close match when the key looks like a typo.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relax.config.relax_config import RelaxConfig
from relax.utils.redact import redact_tree


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says how to fix it."""


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. trainer.lr=1e-4)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    if isinstance(value, str):  # YAML 1.1 reads `1e-4` as a string; a number is meant
        try:
            value = float(value)
        except ValueError:
            pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {text!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _section_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RelaxConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not isinstance(p, int))
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = _section_model(loc[:-1])
            valid = sorted(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f" Did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))!r}?" if close else ""
            lines.append(f"unknown key {key!r}.{hint} Valid keys here: {', '.join(valid)}")
        elif e["type"] == "missing":
            lines.append(f"missing required key {key!r}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg} (got {e.get('input')!r})" if loc else msg)
    return "invalid config:\n  - " + "\n  - ".join(lines)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(data: Any, where: str = "") -> Any:
    """`${NAME}` in a string value is replaced by the environment variable NAME, so credentials need not
    be written in the YAML (`Authorization: "Bearer ${REWARD_TOKEN}"`); a variable that is not set is an
    error naming the key."""
    if isinstance(data, dict):
        return {k: expand_env(v, f"{where}.{k}" if where else str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, str) and "${" in data:

        def value(m: re.Match) -> str:
            if m[1] not in os.environ:
                raise ConfigError(
                    f"{where}: environment variable {m[1]} is not set (the config refers to ${{{m[1]}}})"
                )
            return os.environ[m[1]]

        return _ENV_REF.sub(value, data)
    return data


def build_config(data: dict[str, Any]) -> RelaxConfig:
    try:
        return RelaxConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RelaxConfig:
    """Read `path` (YAML), apply `overrides`, validate. Raises ConfigError with a how-to-fix message."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {path} does not exist (`relax examples list` shows working configs)"
            )
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections (run, model, data, ...)")
    return build_config(expand_env(apply_overrides(data, overrides or [])))


def dump_config(cfg: RelaxConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) so a run folder documents itself; credentials
    are masked (relax/utils/redact.py), so the file can be shared."""
    tmp = Path(path).with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(redact_tree(cfg.model_dump(mode="json")), sort_keys=False))
    tmp.replace(path)
