"""The file paths a config names, resolved on the driver before any role starts.

A relative path in the config (`model.path: .relax/assets/...`, as in examples/quickstart.yaml) means
"relative to where `relax train` runs". Roles run in other processes, on other nodes of a cluster, each in
a working folder of its own; so every such path is made absolute here, once, against the driver's working
folder, and the roles get absolute paths. On a cluster those must be on storage every node sees (the
convention of verl and Relax; docs/cluster.md): `relax.orchestration.preflight` checks that each node
does. Hub data sets (`hf://...`, relax.data.hub_data) become files in the run folder here, so the nodes
need no Hub access for data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from relax.utils.hub import looks_like_hub_id, resolve_model

if TYPE_CHECKING:
    from relax.config.relax_config import RelaxConfig


@dataclass(frozen=True)
class ConfigPath:
    key: str  # where the config names it, e.g. `data.train_files[0]`
    path: str  # absolute after `resolve_paths`
    kind: str  # "model" (a model folder), "file" (a data file), "run" (the run folder, written)


def _abs(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _model(path: str, base: Path, revision: str | None, key: str) -> tuple[str, str | None]:
    """A model folder made absolute, or a Hub id resolved to its snapshot folder and commit
    (relax.utils.hub); the commit is None for a local folder."""
    if looks_like_hub_id(path, base):
        return resolve_model(path, revision, key)
    return _abs(path, base), None


def _data_file(entry: str, base: Path, cfg: RelaxConfig, key: str, default_split: str) -> str:
    """A data file made absolute, or a Hub data set (`hf://...`) written once as a JSONL prompt file into
    the run folder (relax.data.hub_data), whose path every role then reads."""
    from relax.data.dataset import SUPPORTED_EXTENSIONS, DataError
    from relax.data.hub_data import is_hub_dataset, materialize, parse_hub_dataset

    if not is_hub_dataset(entry):
        if looks_like_hub_id(entry, base) and Path(entry).suffix not in SUPPORTED_EXTENSIONS:
            # `openai/gsm8k` as TRL's dataset_name writes it: say how Relax spells a data set
            raise DataError(
                f"{key} = {entry}: no such file; a Hub data set is written "
                f"hf://datasets/{entry}?config=<config>&split=<split> (docs/data.md)"
            )
        return _abs(entry, base)
    ds = parse_hub_dataset(entry, default_split, key)
    return str(materialize(ds, cfg.data, cfg.run.run_dir / "data", key))


def resolve_paths(cfg: RelaxConfig, base: Path | None = None) -> RelaxConfig:
    """Make every path of `cfg` absolute against `base` (default: the working folder), every Hub model id a
    snapshot folder of one commit and every Hub data set a JSONL file in the run folder; returns `cfg`. Paths already absolute are unchanged, so resolving twice
    changes nothing."""
    base = base or Path.cwd()
    cfg.run.output_dir = _abs(cfg.run.output_dir, base)
    revision = cfg.model.revision
    cfg.model.path, commit = _model(cfg.model.path, base, revision, "model.path")
    if cfg.model.reference_path is not None:
        cfg.model.reference_path, _ = _model(cfg.model.reference_path, base, revision, "model.reference_path")
    if commit is not None:
        cfg.model.revision = commit  # config.yaml and every role name the commit, not a branch that moves
    cfg.data.train_files = [
        _data_file(f, base, cfg, f"data.train_files[{i}]", "train")
        for i, f in enumerate(cfg.data.train_files)
    ]
    for es in cfg.eval.sets:
        es.files = [
            _data_file(f, base, cfg, f"eval.sets[{es.name}].files[{i}]", "test")
            for i, f in enumerate(es.files)
        ]
    if cfg.reward.genrm is not None and not cfg.reward.genrm.engine_urls:
        cfg.reward.genrm.model_path, _ = _model(
            cfg.reward.genrm.model_path, base, None, "reward.genrm.model_path"
        )
    agent = cfg.rollout.agent
    if agent.command:  # an agent program given as a relative script runs from the Rollout's own folder
        agent.command = [
            _abs(a, base) if not Path(a).is_absolute() and (base / a).is_file() else a for a in agent.command
        ]
    return cfg


def config_paths(cfg: RelaxConfig) -> list[ConfigPath]:
    """Every path the run reads (model folders, data files) or writes (the run folder)."""
    out = [ConfigPath("model.path", cfg.model.path, "model")]
    if cfg.model.reference_path is not None:
        out.append(ConfigPath("model.reference_path", cfg.model.reference_path, "model"))
    out += [ConfigPath(f"data.train_files[{i}]", f, "file") for i, f in enumerate(cfg.data.train_files)]
    for es in cfg.eval.sets:
        out += [ConfigPath(f"eval.sets[{es.name}].files[{i}]", f, "file") for i, f in enumerate(es.files)]
    if cfg.reward.genrm is not None and not cfg.reward.genrm.engine_urls:
        out.append(ConfigPath("reward.genrm.model_path", cfg.reward.genrm.model_path, "model"))
    out.append(ConfigPath("run.output_dir", str(cfg.run.run_dir), "run"))
    return out


def path_problem(p: ConfigPath) -> str | None:
    """Why this process cannot use `p` (None if it can): a model folder needs `config.json`, a data file
    must be a readable file; the run folder must be creatable and writable."""
    path = Path(p.path)
    try:
        if p.kind == "model":
            if not path.is_dir():
                return "no such folder" if not path.exists() else "not a folder"
            if not (path / "config.json").is_file():
                return "no config.json in it (a Hugging Face model folder has one)"
            return None
        if p.kind == "file":
            if not path.is_file():
                return "no such file" if not path.exists() else "not a file"
            with path.open("rb") as fh:
                fh.read(1)
            return None
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".relax-write-probe-{id(p)}"
        probe.write_text("ok")
        probe.unlink()
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
