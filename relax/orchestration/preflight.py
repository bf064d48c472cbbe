"""Checks before any role starts, so a bad path stops the run in seconds with a clear error instead of a
role failing on some node after minutes.

* `check_local(cfg)`: before Ray starts, on the driver: the optional packages the config needs are
  installed (`check_extras`), every model folder and data file the config names is usable, and the run
  folder is writable.
* `check_nodes(cfg)`: after Ray starts, on every live node of the cluster (roles may land on any): a task
  pinned to the node checks the same paths and writes a probe file with a fresh token into the run
  folder; the driver then reads each node's probe back. A node whose probe the driver does not see writes
  to storage the driver cannot see: the run folder is not shared, and its checkpoints, metrics and eval
  samples would be split across nodes.
"""

from __future__ import annotations

import importlib.util
import logging
import uuid
from pathlib import Path
from typing import Any

from relax.backends.inference.registry import UnknownEngineError, engine_backend
from relax.config import RelaxConfig
from relax.config.paths import ConfigPath, config_paths, path_problem

logger = logging.getLogger(__name__)

NODE_CHECK_TIMEOUT_S = 120.0


class PreflightError(RuntimeError):
    """A path of the config that the driver or a node of the cluster cannot use; says which and how to fix."""


def missing_extras(cfg: RelaxConfig) -> list[str]:
    """What the config asks for that needs an optional package this Python lacks: one line each, naming
    the key, the package and the command that installs it (the extras of pyproject.toml)."""
    needs = []  # (why, importable module, how to install)
    agent = cfg.rollout.agent
    if agent.kind == "multi_turn" and agent.env == "search":
        needs.append(("rollout.agent.env = search (its BM25 index)", "bm25s", "pip install 'relax[agentic]'"))
    if cfg.trainer.lora is not None:
        needs.append(("trainer.lora (LoRA through PEFT)", "peft", "pip install 'relax[lora]'"))
    if cfg.ops.wandb is not None:
        needs.append(("ops.wandb", "wandb", "pip install 'relax[metrics]'"))
    if cfg.ops.notify_urls:
        needs.append(("ops.notify_urls (Apprise)", "apprise", "pip install 'relax[metrics]'"))
    if cfg.ops.clearml is not None:
        needs.append(("ops.clearml", "clearml", "pip install clearml"))
    engine = engine_backend(cfg.rollout.engine)  # the engine backend's own package (SGLang)
    if engine.package is not None:
        needs.append((f"rollout.engine = {engine.name}", engine.package, engine.install))
    return [
        f"{why} needs the package {module!r}, which is not installed: {how}"
        for why, module, how in needs
        if importlib.util.find_spec(module) is None
    ]


def check_extras(cfg: RelaxConfig) -> None:
    """Raise `PreflightError` naming every optional package the config needs and this Python lacks, so
    the run stops in a second with the install command instead of a role's traceback after Ray started."""
    if missing := missing_extras(cfg):
        raise PreflightError(
            "the config needs packages that are not installed:\n  - " + "\n  - ".join(missing)
        )


def check_local(cfg: RelaxConfig) -> None:
    """`rollout.engine` names a known engine backend and `trainer.weight_sync_backend` a known weight
    transport, the optional packages the config needs are
    installed, every path the config names is usable here (the driver), and the data rows are well formed
    for the rewards that score them, before Ray starts."""
    try:
        engine_backend(cfg.rollout.engine)
    except UnknownEngineError as e:
        raise PreflightError(str(e)) from None
    from relax.weights.sender import TRANSPORTS  # here: the node checks import this module without torch

    if cfg.trainer.weight_sync_backend not in TRANSPORTS:
        raise PreflightError(
            f"unknown trainer.weight_sync_backend {cfg.trainer.weight_sync_backend!r}: "
            f"use one of {', '.join(sorted(TRANSPORTS))} (docs/weights.md)"
        )
    check_extras(cfg)
    problems = [f"{p.key} = {p.path}: {why}" for p in config_paths(cfg) if (why := path_problem(p))]
    if problems:
        raise PreflightError(
            "the config names paths this machine cannot use:\n  - "
            + "\n  - ".join(problems)
            + "\nFix the paths (relative ones are resolved against the folder `relax train` runs in)."
        )
    check_data(cfg)


def check_data(cfg: RelaxConfig) -> None:
    """Every row of the training and eval files parses, selects (`metadata.<reward.per_row_key>`) only a
    reward the config allows, and has a label where its reward compares with one; prompts longer than
    `data.max_prompt_len` are refused or warned about (`data.overlong_prompts`). The error names the
    file and line."""
    from relax.data.dataset import DataError, load_prompt_files
    from relax.data.overlong import apply_overlong_policy, dropped_message
    from relax.rewards.registry import allowed_rewards, check_row_reward, resolve_reward

    sets = [("data.train_files", cfg.data.train_files, cfg.reward)]
    sets += [(f"eval.sets[{es.name}]", es.files, es.reward or cfg.reward) for es in cfg.eval.sets]
    tokenizer = None
    for key, files, reward in sets:
        try:
            rows = load_prompt_files(files, cfg.data)
        except DataError as e:
            raise PreflightError(f"{key}: {e}") from None
        tokenizer = tokenizer or _tokenizer(cfg)
        try:
            kept, dropped = apply_overlong_policy(rows, tokenizer, cfg.data, key)
        except DataError as e:
            raise PreflightError(str(e)) from None
        if dropped:  # the one warning; the roles that load the rows drop them again, quietly
            logger.warning(dropped_message(dropped, len(rows), cfg.data, key))
        allowed = allowed_rewards(reward.name, reward.type_kwargs)
        unlabelled: dict[str, list[str]] = {}
        for row in kept:  # dropped rows are never scored
            chosen = row.metadata.get(reward.per_row_key) if reward.per_row_key else None
            rm_type = str(chosen) if chosen else reward.name
            try:
                check_row_reward(rm_type, allowed, row.where)
            except ValueError as e:
                raise PreflightError(str(e)) from None
            if row.label is None and resolve_reward(rm_type).needs_label:
                unlabelled.setdefault(rm_type, []).append(row.where)
        for rm_type, where in unlabelled.items():
            raise PreflightError(
                f"{key}: {len(where)} row(s) have no label ({cfg.data.label_key!r}) but their reward "
                f"{rm_type!r} compares the response with it; the first is {where[0]}. Label the rows, point "
                "data.label_key at the field that holds the answer, or choose a reward that needs none"
            )


def _tokenizer(cfg: RelaxConfig) -> Any:
    """The policy's tokenizer, as the Rollout role loads it, to measure prompts before the start."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.model.path)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a folder it cannot use
        raise PreflightError(
            f"model.path = {cfg.model.path}: cannot load its tokenizer to measure the prompts ({e}); "
            "the folder needs the tokenizer files (tokenizer.json or the model's own)"
        ) from e


def _probe_node(paths: list[ConfigPath], run_dir: str, token: str) -> dict[str, Any]:
    """On one node: the problems with `paths` and the probe file written into the run folder."""
    from relax.utils.hub import ensure_snapshot
    from relax.utils.net import node_ip

    for p in paths:
        if p.kind == "model":
            ensure_snapshot(p.path)  # a Hub model: this node's cache gets the driver's commit
    problems = [(p.key, p.path, why) for p in paths if (why := path_problem(p))]
    probe = None
    if not any(key == "run.output_dir" for key, _, _ in problems):
        probe = Path(run_dir) / f".relax-node-probe-{token}"
        probe.write_text(token)
    return {"node": node_ip(), "problems": problems, "probe": str(probe) if probe else None}


def check_nodes(cfg: RelaxConfig, timeout_s: float = NODE_CHECK_TIMEOUT_S) -> None:
    """Every live node of the cluster can use the config's paths, and its writes to the run folder reach
    the storage the driver sees. Raises `PreflightError` naming each node and path that fails."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    paths = config_paths(cfg)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe_node)
    tokens = {n["NodeID"]: uuid.uuid4().hex for n in nodes}
    calls = {
        n["NodeID"]: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(paths, str(cfg.run.run_dir), tokens[n["NodeID"]])
        for n in nodes
    }
    problems: list[str] = []
    for node in nodes:
        address = node["NodeManagerAddress"]
        try:
            answer = ray.get(calls[node["NodeID"]], timeout=timeout_s)
        except GetTimeoutError:
            problems.append(f"node {address}: did not answer the path check within {timeout_s:.0f}s")
            continue
        problems += [f"node {address}: {key} = {path}: {why}" for key, path, why in answer["problems"]]
        if answer["probe"] is not None:
            seen = Path(answer["probe"])
            token = tokens[node["NodeID"]]
            if not seen.is_file() or seen.read_text() != token:
                problems.append(
                    f"node {address}: writes to run.output_dir = {cfg.run.output_dir} land on storage the "
                    "driver does not see (the run folder must be on storage every node shares)"
                )
            seen.unlink(missing_ok=True)
    if problems:
        raise PreflightError(
            "nodes of the cluster cannot use the config's paths:\n  - "
            + "\n  - ".join(problems)
            + "\nEvery node that may run a role must see the model and data paths and the run folder at the "
            "same path: put them on shared storage, or keep roles off such nodes with resources.placement "
            "(docs/cluster.md)."
        )
    logger.info("paths checked on %d node(s)", len(nodes))
