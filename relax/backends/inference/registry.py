"""Which inference engine backends exist: one `EngineBackend` entry per value of `rollout.engine`.

An entry owns everything the rest of Relax asks about an engine kind, so no code outside this module
tests an engine's name:

* how its engines come to be: `start(cfg)` launches them in the run's Ray cluster (embedded, SGLang) or
  attaches to the URLs the config gives (external); `provider(cfg)` starts one more at a time for the
  elastic API's `ray_native` scale-out, where the backend can;
* its GPU-plan rule (`relax.orchestration.gpus`): whether its engines sit in the cluster (their GPUs
  and CPUs are planned and fitted) and the share of a GPU each engine takes in a mode;
* the weight formats its engines accept (`WEIGHT_FORMATS`), which decide the trainer's defaults
  (`trainer.weight_sync_flatten`, CUDA IPC);
* the optional package it needs on the driver, named with its install command before Ray starts.

Adding a backend is one module beside this one and one entry in `ENGINES` (docs/engine_backends.md).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from relax.config import RelaxConfig
from relax.utils.placement import ray_placement

# What a weight push may hand an engine: `flat` (each bucket as one packed buffer over the group),
# `per_tensor` (one broadcast per tensor, SGLang's `update_weights_from_distributed`), `cuda_ipc` (a
# handle to the trainer's GPU memory, for an engine on a training rank's GPU), `disk` (a checkpoint
# folder, `update_weights_from_disk`).
WEIGHT_FORMATS = frozenset({"flat", "per_tensor", "cuda_ipc", "disk"})


class EngineSet(Protocol):
    """The engines a backend started or attached to. For engines in the cluster `actors[i]` hosts the
    engine at `urls[i]`; the fleet's supervisor replaces a failed one with `launch(i)`."""

    urls: list[str]
    actors: list[Any]

    def launch(self, i: int) -> Any: ...

    def stop(self) -> None: ...


def gpu_share_rule(mode: str, gpus: int) -> float:
    """The default GPU-plan rule: none on CPU; colocate: half a GPU, beside one training rank (they take
    turns); hybrid and fully_async: a GPU of its own. Engines outside the cluster hold none of its GPUs,
    but their share still tells the plan that they are GPU engines (weight sync over NCCL)."""
    if gpus == 0:
        return 0.0
    return 0.5 if mode == "colocate" else 1.0


class UnknownEngineError(ValueError):
    """`rollout.engine` names no registered backend."""


@dataclass(frozen=True)
class EngineBackend:
    name: str
    summary: str  # one line for errors and `relax config --describe` readers
    start: Callable[[RelaxConfig], EngineSet]
    in_cluster: bool  # Relax starts its engines in the run's Ray cluster: the GPU plan and fit count them
    weight_formats: frozenset[str]
    provider: Callable[[RelaxConfig], Any] | None = None  # elastic `ray_native`: one more engine at a time
    package: str | None = None  # module the driver must import for it (None: none beyond Relax's own)
    install: str = ""  # the command that installs `package`
    gpu_share: Callable[[str, int], float] = gpu_share_rule  # (schedule.mode, cluster GPUs) -> per engine

    def __post_init__(self) -> None:
        if unknown := self.weight_formats - WEIGHT_FORMATS:
            raise ValueError(f"engine backend {self.name}: unknown weight formats {sorted(unknown)}")

    def engine_gpus(self, mode: str, gpus: int) -> float:
        """The GPU-plan rule: each engine's automatic GPU share in `schedule.mode = mode` on a cluster
        of `gpus` GPUs."""
        return self.gpu_share(mode, gpus)

    def accepts(self, weight_format: str) -> bool:
        return weight_format in self.weight_formats

    def missing_package(self) -> str | None:
        """Why this backend cannot start from this Python (its package is not installed), or None."""
        if self.package is None or importlib.util.find_spec(self.package) is not None:
            return None
        return (
            f"rollout.engine = {self.name} needs the package {self.package!r}, which is not installed: "
            f"{self.install}"
        )


def workload_tokens(cfg: RelaxConfig) -> int:
    """The most tokens a run's requests can hold in one engine at once: every running row at the longest
    prompt plus the longest response budget of training and eval (an agent's includes the environment's
    tokens). An overestimate (a group's samples share their prompt's blocks), so the KV ceiling derived
    from it never preempts a workload that would have fit."""
    r = cfg.rollout
    budgets = [r.max_new_tokens, *(s.max_new_tokens or 0 for s in cfg.eval.sets)]
    if r.agent.kind != "single_turn":
        budgets.append(r.agent.max_total_tokens)
    return r.engine_max_running * (cfg.data.max_prompt_len + max(budgets))


def shares_gpu_with_trainer(cfg: RelaxConfig) -> bool:
    """Colocate on GPUs: each engine takes turns with a training rank on one GPU."""
    r = cfg.resources
    return cfg.schedule.mode == "colocate" and (r.engine_gpus or 0) > 0 and (r.trainer_gpus or 0) > 0


def engine_kwargs(cfg: RelaxConfig) -> dict[str, Any]:
    """What every embedded engine of the run is started with (besides its model folder)."""
    return {
        "dtype": cfg.model.dtype,
        "max_running": cfg.rollout.engine_max_running,
        "max_total_tokens": cfg.rollout.engine_max_total_tokens,
        "kv_memory_fraction": cfg.rollout.engine_kv_memory_fraction,
        "workload_tokens": workload_tokens(cfg),
        # beside a training rank on its GPU the pool is allocated whole at start: the rank plans its memory
        # around what the engine holds when it first runs, so a pool that grew later would not fit
        "kv_preallocate": shares_gpu_with_trainer(cfg),
        "threads": cfg.rollout.engine_threads,
        "enable_prefix_cache": cfg.rollout.engine_prefix_cache,
        "chunked_prefill_size": cfg.rollout.engine_chunked_prefill_size,
        "seed": cfg.run.seed,
    }


def _start_embedded(cfg: RelaxConfig) -> EngineSet:
    from relax.backends.inference.engine_actors import EngineGroup

    r = cfg.resources
    return EngineGroup(
        cfg.model.path,
        cfg.rollout.num_engines,
        engine_kwargs(cfg),
        num_gpus=r.engine_gpus or 0.0,
        gpu_group=r.gpu_group,
        cpus=r.rollout_cpus,
        bind=r.bind,
        placement=ray_placement(cfg, "engines"),
    )


def _embedded_provider(cfg: RelaxConfig) -> Any:
    from relax.backends.inference.engine_actors import RayEngineProvider

    r = cfg.resources
    return RayEngineProvider(
        cfg.model.path,
        engine_kwargs(cfg),
        num_gpus=r.engine_gpus or 0.0,
        cpus=r.rollout_cpus,
        bind=r.bind,
        placement=ray_placement(cfg, "engines"),
    )


class AttachedEngines:
    """External engines: their URLs, nothing to launch or stop (they run before and after the run)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.actors = list(urls), []

    def launch(self, i: int) -> Any:
        raise RuntimeError("external engines are not started by Relax, so it cannot replace one")

    def stop(self) -> None:
        pass


def _attach_external(cfg: RelaxConfig) -> EngineSet:
    return AttachedEngines(cfg.rollout.engine_urls)  # the config refuses external without URLs


def _start_sglang(cfg: RelaxConfig) -> EngineSet:
    from relax.backends.inference.sglang import start_sglang_engines

    return start_sglang_engines(cfg)


ENGINES: dict[str, EngineBackend] = {
    b.name: b
    for b in (
        EngineBackend(
            "embedded",
            "Relax's own engine, started as Ray actors in the run's cluster",
            _start_embedded,
            in_cluster=True,
            weight_formats=frozenset({"flat", "per_tensor", "cuda_ipc", "disk"}),
            provider=_embedded_provider,
        ),
        EngineBackend(
            "external",
            "engines already serving at rollout.engine_urls (the engine_api contract)",
            _attach_external,
            in_cluster=False,
            weight_formats=frozenset({"per_tensor", "disk"}),
        ),
        EngineBackend(
            "sglang",
            "SGLang servers (python -m sglang.launch_server), started as Ray actors in the run's cluster",
            _start_sglang,
            in_cluster=True,
            weight_formats=frozenset({"per_tensor", "disk"}),
            package="sglang",
            install="pip install 'relax[sglang]' on every node that runs an engine",
        ),
    )
}


def engine_backend(name: str) -> EngineBackend:
    """The entry for `rollout.engine = name`; an unknown name raises `UnknownEngineError` listing the
    known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        known = ", ".join(sorted(ENGINES))
        raise UnknownEngineError(
            f"rollout.engine={name!r} is no engine backend; the known ones are: {known} "
            "(relax/backends/inference/registry.py; docs/engine_backends.md adds one)"
        ) from None
