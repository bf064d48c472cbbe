"""The Controller owns the training loop: generate -> train (old/ref log-probs, advantages, update) ->
push weights -> log -> checkpoint. Roles are Ray Serve deployments reached through handles; no maths and
no Ray fan-out live here. The modes differ only in where a step's rollout starts: here, on request
(colocate), or ahead of training in the Rollout's background task (hybrid, fully_async; `StepFlow`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from relax.config import RelaxConfig, dump_config
from relax.distributed.data_plane import DataPlane, create_data_plane
from relax.orchestration import checkpoint as ckpt
from relax.orchestration import gpus, service
from relax.orchestration.async_loop import StepFlow
from relax.orchestration.progress import Progress
from relax.orchestration.registry import roles_for_mode
from relax.utils.metrics import build_sinks
from relax.utils.timer import timer

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, cfg: RelaxConfig, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run.run_dir
        self.resume = resume
        self.stop_requested = False
        self.handles: dict = {}
        self.flow: StepFlow | None = None
        self.plane: DataPlane | None = None
        self._owns_ray = False
        self._gpu_group = None  # colocate on GPUs: the placement group engines and ranks share

    # -- life cycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `trainer.num_steps`; returns the last completed step."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        found = ckpt.latest_checkpoint(self.run_dir) if self.resume else None
        if self.resume and found is None:
            logger.warning("--resume: no complete checkpoint in %s; starting from step 0", self.run_dir)
        if not self.resume and ckpt.latest_checkpoint(self.run_dir) is not None:
            raise FileExistsError(
                f"{self.run_dir} already holds checkpoints; pass --resume to continue that run, "
                "or choose another run.name / run.output_dir"
            )
        dump_config(self.cfg, self.run_dir / "config.yaml")
        start_step = found[0] if found else 0
        old_handlers = self._install_signal_handlers()
        try:
            self._start_roles()
            if found:
                self._restore(found[1])
            self.flow.push_weights(start_step)  # engines start from the trainer's weights and version
            self.flow.start(start_step + 1)
            return self._loop(start_step)
        finally:
            signal.signal(signal.SIGINT, old_handlers[0])
            signal.signal(signal.SIGTERM, old_handlers[1])
            self._shutdown()

    def _start_roles(self) -> None:
        r = self.cfg.resources
        self._owns_ray = service.start_ray(r.ray_address, r.num_cpus, r.object_store_mb, r.num_gpus)
        gpus.plan_gpus(self.cfg, gpus.cluster_gpus())
        self._gpu_group = gpus.ensure_gpu_group(self.cfg, gpus.cluster_gpus())
        service.start_serve()
        self.plane = create_data_plane(r.data_plane)
        for role in roles_for_mode(r.mode, self.cfg):
            self.handles[role.name] = service.deploy_role(
                role.name,
                role.cls,
                self.cfg,
                num_cpus=role.num_cpus,
                num_gpus=gpus.role_gpus(self.cfg, role.name),
                **role.kwargs,
            )
        self.rollout, self.actor = self.handles["rollout"], self.handles["actor"]
        self.flow = StepFlow(r.mode, self.handles)
        urls = self.rollout.engine_urls.remote().result()
        self.actor.connect_engines.remote(urls + self.flow.receivers).result()

    def _shutdown(self) -> None:
        if self.flow is not None:
            self.flow.stop()
        try:
            if "rollout" in self.handles:
                self.handles["rollout"].stop_engines.remote().result(timeout_s=60)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("rollout shutdown failed")
        if self.plane is not None:
            asyncio.run(self.plane.close())
        service.shutdown(stop_ray=self._owns_ray)
        if self._gpu_group is not None and not self._owns_ray:
            from ray.util import remove_placement_group

            remove_placement_group(self._gpu_group)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self, start_step: int) -> int:
        cfg = self.cfg
        sinks = build_sinks(self.run_dir, cfg.ops.tensorboard, start_step if self.resume else None)
        progress = Progress(cfg.trainer.num_steps, start_step, enabled=cfg.ops.progress)
        step = start_step
        ev = cfg.eval
        try:
            if ev.sets and ev.before_train and step == 0:
                sinks.log(0, self._evaluate(0))
            while step < cfg.trainer.num_steps and not self.stop_requested:
                times: dict[str, float] = {}
                with timer("step_time", times):
                    with timer("rollout", times):
                        if self.flow.streaming:  # started ahead, in the background, gated by staleness
                            rollout_metrics = self.rollout.metrics.remote(step + 1).result()
                        else:
                            rollout_metrics = self.rollout.generate.remote(step + 1).result()
                    with timer("train", times):
                        train_metrics = self.flow.train(step + 1)
                    with timer("weight_sync", times):
                        version = self.flow.push_weights(step + 1)
                step += 1
                metrics = {**rollout_metrics, **train_metrics, **times, "weight_version": version}
                last = step == cfg.trainer.num_steps
                if ev.sets and ((ev.interval and step % ev.interval == 0) or (last and ev.at_end)):
                    metrics.update(self._evaluate(step))
                sinks.log(step, metrics)
                progress.update(step, metrics, log=step % cfg.ops.log_interval == 0)
                interval = cfg.ops.checkpoint_interval
                if interval and step % interval == 0 and step < cfg.trainer.num_steps:
                    self._save(step)
            if step > start_step or not ckpt.latest_checkpoint(self.run_dir):
                self._save(step)
            if self.stop_requested:
                logger.info("stopped at step %d; resume with: relax train ... --resume", step)
        finally:
            progress.close()
            sinks.close()
        return step

    def _evaluate(self, step: int) -> dict[str, float]:
        times: dict[str, float] = {}
        with timer("eval", times):
            metrics = self.rollout.evaluate.remote(step).result()
        return {**metrics, **times}

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        t0 = time.perf_counter()
        d = ckpt.begin(self.run_dir, step)
        self.actor.save.remote(str(d / "actor")).result()
        self.rollout.save.remote(str(d / "rollout.json")).result()
        ckpt.finish(self.run_dir, step, {"run": self.cfg.run.name}, keep=self.cfg.ops.keep_checkpoints)
        logger.info("checkpoint step %d saved to %s (%.1fs)", step, d, time.perf_counter() - t0)

    def _restore(self, d: Path) -> None:
        self.actor.load.remote(str(d / "actor")).result()
        self.rollout.load.remote(str(d / "rollout.json")).result()
        logger.info("resumed from %s", d)

    # -- signals -----------------------------------------------------------------------------
    def _install_signal_handlers(self):
        def handler(signum, frame):
            if self.stop_requested:
                raise KeyboardInterrupt
            self.stop_requested = True
            logger.warning(
                "%s: finishing the current step, then saving a checkpoint (press Ctrl-C again to abort)",
                signal.Signals(signum).name,
            )

        return signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, handler)
