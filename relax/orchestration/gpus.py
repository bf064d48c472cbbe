"""How a run's roles share the cluster's GPUs: one function that turns `resources.*_gpus = None` (auto)
into numbers before the roles are deployed, so every role reads its share from the config.

Auto rules, with G the cluster's GPUs, E = `rollout.num_engines` and R = `trainer.num_ranks`:

* G = 0: everything on CPU (all shares 0, weight sync over gloo).
* colocate: rollout and training take turns on the same GPUs, so each GPU holds one training rank and
  one engine: trainer_gpus = engine_gpus = 0.5. NCCL refuses two ranks of one communicator on one GPU,
  so weight sync goes through host memory (gloo) unless the config asks for NCCL explicitly.
* The engines' share and whether they count against the cluster's GPUs (external engines do not) is
  their backend's rule (`relax.backends.inference.registry`: `EngineBackend.engine_gpus`, `in_cluster`);
  so are the trainer's weight-format defaults (packed buckets, CUDA IPC) that the engines accept.
* hybrid, fully_async: the GPUs are split; the trainer's ranks take one GPU each and the engines one
  each (E + R <= G); in fully_async the ActorFwd and Reference roles take a quarter of a GPU each,
  beside the trainer's ranks (trainer_gpus 0.5 then, so the forward roles fit on the last rank's GPU).
  Weight sync runs over NCCL between distinct GPUs (hybrid); in fully_async the ActorFwd receiver sits
  on the trainer's GPU, which NCCL refuses, so the group falls back to gloo there (a CUDA-IPC hand-off
  from the trainer to ActorFwd on the same GPU is the planned fix).

An explicit number in the config always wins; the plan only fills what is None.
"""

from __future__ import annotations

import logging

from relax.backends.inference.registry import engine_backend
from relax.config import RelaxConfig

logger = logging.getLogger(__name__)


def cluster_gpus() -> int:
    """GPUs the connected Ray cluster offers."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def plan_gpus(cfg: RelaxConfig, gpus: int) -> RelaxConfig:
    """Fill the auto (None) GPU shares of `cfg.resources` for a cluster with `gpus` GPUs; returns `cfg`."""
    r, t = cfg.resources, cfg.trainer
    backend = engine_backend(cfg.rollout.engine)
    wants_gpu = gpus > 0 and t.device != "cpu"
    if not wants_gpu:
        engine, trainer, fwd = 0.0, 0.0, 0.0
    elif cfg.schedule.mode == "colocate":
        # one training rank per GPU beside its engine (NCCL refuses two ranks of a group on one GPU)
        engine, trainer, fwd = backend.engine_gpus("colocate", gpus), 0.5, 0.0
        if t.num_ranks > gpus and t.uses_group:
            if t.device == "cuda":
                raise ValueError(
                    f"schedule.mode=colocate puts one training rank on each GPU beside an engine: "
                    f"trainer.num_ranks={t.num_ranks} needs {t.num_ranks} GPUs and the cluster has {gpus}. "
                    "Lower trainer.num_ranks, or train on the CPU with trainer.device=cpu"
                )
            trainer = 0.0  # `auto`: the ranks train on the CPU, the engines keep the GPUs
            logger.warning(
                "trainer.device=auto: %d training ranks but %d GPU(s) in colocate, so the ranks train on "
                "the CPU; set trainer.num_ranks <= the GPUs to train on them",
                t.num_ranks,
                gpus,
            )
    else:
        fwd = 0.25 if cfg.schedule.mode == "fully_async" else 0.0
        engine, trainer = backend.engine_gpus(cfg.schedule.mode, gpus), (0.5 if fwd else 1.0)
        need = cfg.rollout.num_engines * engine + t.num_ranks * trainer + (2 * fwd)
        if backend.in_cluster and need > gpus:
            raise ValueError(
                f"schedule.mode={cfg.schedule.mode} splits the GPUs between {cfg.rollout.num_engines} engine(s) and "
                f"{t.num_ranks} training rank(s) and needs {need:g} GPUs; the cluster has {gpus}. Lower "
                "rollout.num_engines / trainer.num_ranks, use mode=colocate, or set resources.engine_gpus / "
                "trainer_gpus to fractions"
            )
    if r.engine_gpus is None:
        r.engine_gpus = engine
    if r.trainer_gpus is None:
        r.trainer_gpus = trainer
    if r.fwd_gpus is None:
        r.fwd_gpus = fwd
    if t.weight_sync_flatten is None:  # packed buckets where the engines take them
        t.weight_sync_flatten = backend.accepts("flat")
    if t.weight_sync_backend == "auto":
        # A GPU holding two members of one NCCL group (a rank and an engine in colocate; the trainer and
        # ActorFwd in fully_async) rules NCCL out, unless those receivers take CUDA IPC instead: ActorFwd
        # does, and engines whose backend accepts `cuda_ipc` (embedded); others (SGLang) need gloo.
        ipc = t.weight_sync_ipc and backend.accepts("cuda_ipc")
        colocated_engines = (
            cfg.schedule.mode == "colocate" and r.engine_gpus > 0 and r.trainer_gpus > 0 and not ipc
        )
        shared = colocated_engines or ((r.fwd_gpus or 0) > 0 and not t.weight_sync_ipc)
        t.weight_sync_backend = "nccl" if r.engine_gpus > 0 and r.trainer_gpus > 0 and not shared else "gloo"
    if wants_gpu:
        logger.info(
            "GPU plan (%d GPUs, %s): %g per engine x %d, %g per training rank x %d, %g per forward role; "
            "weight sync over %s",
            gpus,
            cfg.schedule.mode,
            r.engine_gpus,
            cfg.rollout.num_engines,
            r.trainer_gpus,
            t.num_ranks,
            r.fwd_gpus,
            t.weight_sync_backend,
        )
    return cfg


COLOCATE_GROUP = "relax-gpus"


def ensure_gpu_group(cfg: RelaxConfig, gpus: int, cpus_per_bundle: float = 2.0):
    """Colocate on GPUs: create the named placement group of `gpus` one-GPU bundles (one per GPU) that
    the engines and training ranks share, so engine i and rank i sit on the same GPU; returns it (None in
    the other modes or without GPUs)."""
    r = cfg.resources
    shared = r.engine_gpus and r.trainer_gpus and cfg.trainer.uses_group  # ranks are Ray actors
    if cfg.schedule.mode != "colocate" or gpus == 0 or not shared:
        return None
    import ray
    from ray.util.placement_group import placement_group

    name = r.gpu_group or COLOCATE_GROUP
    pg = placement_group([{"GPU": 1, "CPU": cpus_per_bundle}] * gpus, strategy="PACK", name=name)
    ray.get(pg.ready(), timeout=300)
    r.gpu_group = name
    return pg


def role_gpus(cfg: RelaxConfig, role: str) -> float:
    """GPUs of a Serve role's replica: the forward roles; the Actor when it trains in process (torch)."""
    r = cfg.resources
    if role in ("actor_fwd", "reference"):
        return r.fwd_gpus or 0.0
    if role == "actor" and not cfg.trainer.uses_group:
        return r.trainer_gpus or 0.0
    return 0.0
