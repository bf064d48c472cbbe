"""The Controller owns the training loop: generate -> train (old/ref log-probs, advantages, update) ->
push weights -> log -> checkpoint. Roles are Ray Serve deployments reached through handles; no maths and
no Ray fan-out live here. The modes differ only in where a step's rollout starts: here, on request
(colocate), or ahead of training in the Rollout's background task (hybrid, fully_async; `StepFlow`).

Failures: the HealthManager (`health.py`) restarts stateless roles and engines in place while the loop
runs; a failure that loses training state ends the attempt and `recovery.run_with_restarts` starts
another from the last checkpoint. Metrics go to the Metrics service; notifications through Apprise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path

from pydantic import SecretStr

from relax.config import RelaxConfig, dump_config, register_config_secrets
from relax.config.modes import overlaps_push, resolve_auto
from relax.config.paths import resolve_paths
from relax.dataplane.plane import DataPlane, create_data_plane
from relax.dataplane.tq_start import DataPlaneStartError
from relax.ops.heartbeat import close_board
from relax.ops.notify import Notifier
from relax.ops.trace import StepPhases
from relax.orchestration import checkpoint as ckpt
from relax.orchestration import fit, gpus, preflight, service
from relax.orchestration.health import HealthManager
from relax.orchestration.progress import Progress
from relax.orchestration.recovery import run_with_restarts
from relax.orchestration.registry import RoleSpec, roles_for
from relax.orchestration.step_flow import POLL_S, StepFlow
from relax.orchestration.watchdog import Watchdog
from relax.roles.metrics import MetricsRole
from relax.utils.auth import set_process_token
from relax.utils.net import bind_address, resolve_bind
from relax.utils.placement import ray_placement
from relax.utils.redact import write_secret_file
from relax.utils.timer import timer

# After a second stop signal, the most the clean-up may take before the process exits anyway (a thread
# stuck in a call to Ray must not keep it alive); within the ops.stop_grace_s + 10 s a stop promises.
HARD_EXIT_S = 10.0
SUMMARY = ("rollout/reward_mean", "train/loss", "health/role_restarts", "health/engine_restarts")

logger = logging.getLogger(__name__)


class _Background:
    """`fn(*args)` on a daemon thread: a call stuck in Ray never keeps the process from exiting, and the
    waiting thread can give up on it."""

    WAIT_SLICE_S = 0.2  # how often `result` looks at its `check`

    def __init__(self, fn, *args) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._value, self._error, self._close = None, None, None
        self._finished = threading.Event()
        threading.Thread(target=self._run, args=(fn, *args), name="data-plane", daemon=True).start()

    def _run(self, fn, *args) -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            value, error = None, e
        with self._lock:
            self._value, self._error, self._done = value, error, True
            close = self._close
        self._finished.set()
        if close is not None and value is not None:
            close(value)  # given up on: nobody else will close it

    def abandon(self, close) -> None:
        """Nobody will take the value: `close(value)` now if it is there, else when it comes."""
        with self._lock:
            done, self._close = self._done, close
        if done and self._value is not None:
            close(self._value)

    def result(self, check, close):
        """The value, calling `check()` (which raises to give up; the value then goes to `close`)
        between short waits."""
        try:
            while not self._finished.wait(self.WAIT_SLICE_S):
                check()
        except BaseException:
            self.abandon(close)
            raise
        if self._error is not None:
            raise self._error
        return self._value


def _close_plane(plane: DataPlane) -> None:
    try:
        asyncio.run(plane.close())
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.exception("closing the data plane failed")


class Controller:
    def __init__(self, cfg: RelaxConfig, *, resume: bool = False) -> None:
        self.cfg = resolve_paths(cfg)  # on the driver, before any role sees a path
        self.run_dir = cfg.run.run_dir
        self.resume = resume
        self.stop_requested = False
        self.handles: dict = {}
        self.flow: StepFlow | None = None
        self.plane: DataPlane | None = None
        self._owns_ray = False
        self.health: HealthManager | None = None
        self.specs: dict[str, RoleSpec] = {}
        self.last_metrics: dict[str, float] = {}
        self._flushing = None  # the last step's metrics flush, awaited before the next one
        self._gpu_group = None  # colocate on GPUs: the placement group engines and ranks share
        self._config_written = False
        self._stop_asked_at: float | None = None  # when the first stop signal came (monotonic)
        self.watchdog = Watchdog(cfg.ops.step_timeout_s, cfg.ops.stop_grace_s, lambda: self._stop_asked_at)

    # -- life cycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `trainer.num_steps`; returns the last completed step."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        found = ckpt.latest_checkpoint(self.run_dir, log=True) if self.resume else None
        if self.resume and found is None:
            logger.warning("--resume: no complete checkpoint in %s; starting from step 0", self.run_dir)
        if not self.resume and ckpt.latest_checkpoint(self.run_dir) is not None:
            raise FileExistsError(
                f"{self.run_dir} already holds checkpoints; pass --resume to continue that run, "
                "or choose another run.name / run.output_dir"
            )
        preflight.check_local(self.cfg)
        old_handlers = self._install_signal_handlers()  # a stop while starting ends the start too
        r = self.cfg.resources  # Ray first: the HealthManager's heartbeat board is a Ray actor
        self._owns_ray = self._start_ray()
        self._install_signal_handlers()  # again: starting Ray's core worker put its own SIGTERM handler in
        notifier = Notifier(self.cfg.ops.notify_urls, self.cfg.run.name)
        try:
            # what is decided automatically is decided before config.yaml records what runs
            gpus.plan_gpus(self.cfg, gpus.cluster_gpus())
            fit.check_cluster_fit(self.cfg, self._role_specs(None))  # before any actor: seconds, not a hang
            self._check_stop("the cluster was checked")
            preflight.check_nodes(self.cfg)
            self._check_stop("the nodes were checked")
            resolve_auto(self.cfg)
            r.bind = resolve_bind(r.bind)
            self._run_token()
            notifier.run_started(found[0] if found else 0, self.cfg.trainer.num_steps, self.cfg.schedule.mode)
            self.health = HealthManager(self.cfg, notifier)
            step = run_with_restarts(
                self._attempt,
                resume=self.resume,
                run_dir=self.run_dir,
                max_restarts=self.cfg.ops.max_global_restarts,
                notifier=notifier,
            )
        except BaseException as e:
            notifier.failure("the run stopped", e)
            raise
        finally:
            set_process_token(None)  # the run's token ends with it (a process may run several)
            signal.signal(signal.SIGINT, old_handlers[0])
            signal.signal(signal.SIGTERM, old_handlers[1])
            try:
                close_board()  # the next run in this cluster starts a fresh one
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("closing the heartbeat board failed")
            service.shutdown(stop_ray=self._owns_ray)
        notifier.run_ended(
            step, {k: v for k, v in self.last_metrics.items() if k in SUMMARY or k.startswith("eval/")}
        )
        return step

    def _attempt(self, resume: bool) -> int:
        """Start every role, restore the last checkpoint when resuming, and train; roles stop at the end."""
        found = ckpt.latest_checkpoint(self.run_dir) if resume else None
        start_step = found[0] if found else 0
        try:
            self._start_roles(start_step if resume else None)
            if found:
                self._restore(found[1])
            if not self._config_written:  # a resume that failed to start leaves the run's record as it was
                dump_config(self.cfg, self.run_dir / "config.yaml")
                self._config_written = True
            self.flow.push_weights(start_step)  # engines start from the trainer's weights and version
            self.flow.start(start_step + 1)
            return self._loop(start_step)
        except Exception as e:
            failure = self.health.failure_behind(e)
            if failure is None:
                raise
            raise failure from e
        finally:
            self._stop_roles()

    def _start_ray(self) -> bool:
        """Start (or join) Ray; True when this run started the cluster (and so stops it)."""
        r = self.cfg.resources
        return service.start_ray(
            r.ray_address,
            r.num_cpus,
            r.object_store_mb,
            r.num_gpus,
            secrets_dir=self.run_dir / "secrets",
            log_dir=self.run_dir / "logs",
            dashboard=r.dashboard,
        )

    def _start_roles(self, resume_step: int | None) -> None:
        self._owns_ray = self._start_ray() or self._owns_ray  # a global restart finds Ray up
        r = self.cfg.resources
        gpus.plan_gpus(self.cfg, gpus.cluster_gpus())
        self._check_stop("the roles started")
        self._gpu_group = gpus.ensure_gpu_group(self.cfg, gpus.cluster_gpus())
        service.start_serve(self.run_dir / "logs")
        self.specs = {spec.name: spec for spec in self._role_specs(resume_step)}
        self.health.known.clear()
        # The data plane (TransferQueue's controller and storage units: seconds of process start-up on a
        # small host) starts while the roles' replicas start; roles connect to it on first use, which
        # is after this method returns.
        plane = _Background(
            create_data_plane,
            self.cfg.schedule.data_plane,
            bind_address(r.bind),
            {"num_cpus": r.data_plane_cpus, **ray_placement(self.cfg, "data_plane")},
        )
        try:
            roles = [self._role(name) for name in self.specs]
            self.handles.update(service.deploy_roles(roles, should_stop=lambda: self.stop_requested))
        except BaseException:
            plane.abandon(_close_plane)  # a stop or a failed role does not wait for it
            raise
        try:
            self.plane = plane.result(lambda: self._check_stop("the data plane started"), _close_plane)
        except DataPlaneStartError as e:
            raise service.RoleStartError("data_plane", str(e)) from e
        self.health.watch(list(self.specs))
        self.rollout, self.actor, self.metrics = (
            self.handles["rollout"],
            self.handles["actor"],
            self.handles["metrics"],
        )
        self.flow = StepFlow(self.cfg.schedule.mode, self.handles, self.health)
        self.flow.redeploy = self._redeploy
        self.flow.overlap = overlaps_push(self.cfg)
        self.flow.watch = self.watchdog.check
        self.flow.weights.wait = self.watchdog.wait
        self.flow.group.reform(
            self.watchdog.wait(self.rollout.engine_urls.remote(), "rollout", "the engine list")
        )

    def _role_specs(self, resume_step: int | None) -> list[RoleSpec]:
        return [RoleSpec("metrics", MetricsRole, 0.25, {"resume_step": resume_step}), *roles_for(self.cfg)]

    def _check_stop(self, phase: str) -> None:
        """Raise `RunStopped` when a stop was requested (start-up checks this between its phases)."""
        if self.stop_requested:
            raise service.RunStopped(f"stop requested before {phase}")

    def _role(self, name: str, **override) -> service.RoleDeployment:
        spec = self.specs[name]
        return service.RoleDeployment(
            name,
            spec.cls,
            (self.cfg,),
            {**spec.kwargs, **override},
            num_cpus=spec.num_cpus,
            num_gpus=gpus.role_gpus(self.cfg, name),
            heartbeat_s=self.cfg.ops.heartbeat_interval_s,
            cpus=getattr(self.cfg.resources, f"{spec.budget}_cpus") if spec.budget else None,
            placement=ray_placement(self.cfg, name),
        )

    def _deploy(self, name: str, **override):
        return service.deploy_roles([self._role(name, **override)], should_stop=lambda: self.stop_requested)[
            name
        ]

    def _redeploy(self, name: str):
        """Restart role `name` in place (the HealthManager's call); a new Metrics replica appends."""
        service.delete_role(name)
        self.handles[name] = self._deploy(name, **({"resume_step": None} if name == "metrics" else {}))
        if name == "metrics":
            self.metrics = self.handles[name]
        return self.handles[name]

    def _stop_roles(self) -> None:
        if self.flow is not None:
            self.flow.stop()
        for name, call in (("rollout", "stop_engines"), ("metrics", "close")):
            try:
                if name in self.handles:
                    getattr(self.handles[name], call).remote().result(timeout_s=60)
            except Exception:  # noqa: BLE001 - best effort on the way out; the replica may be gone
                logger.exception("%s: %s failed", name, call)
        self.handles.clear()
        if self.plane is not None:
            asyncio.run(self.plane.close())
            self.plane = None
        service.delete_roles()  # Serve itself stops with the run (`service.shutdown`)
        if self._gpu_group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self._gpu_group)
            self._gpu_group = None

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self, start_step: int) -> int:
        cfg = self.cfg
        progress = Progress(cfg.trainer.num_steps, start_step, enabled=cfg.ops.progress)
        step = start_step
        ev = cfg.eval
        try:
            if ev.sets and ev.before_train and step == 0:
                self.metrics.flush.remote(0, self._evaluate(0)).result()
            # a stop request ends the loop once no update sent ahead (overlap_push) is left unpushed
            while step < cfg.trainer.num_steps and (not self.stop_requested or self.flow.training_ahead):
                # restarts failed stateless roles; a lost Actor ends the attempt. The last step's
                # post-train checks (read during its push) count when they are recent.
                self.flow.check(max_age_s=POLL_S)
                self.watchdog.begin_step(step + 1)
                phases = StepPhases()
                with phases.phase("step_time"):
                    # streaming modes: the step was started ahead, in the background, gated by
                    # staleness; the Actor waits for its rows itself, and its metrics come with the push
                    if not self.flow.streaming:
                        with phases.phase("rollout"):
                            generated = self.rollout.generate.remote(step + 1)
                            rollout_metrics = self.watchdog.wait(generated, "rollout", "the rollout")
                    with phases.phase("train"):
                        train_metrics = self.flow.train(step + 1)
                    # first: the push is on fully_async's critical chain
                    self.flow.begin_push(step + 1, rollout_metrics=self.flow.streaming)
                    if self._may_train_ahead(step + 2):  # overlap_push: step + 2 trains during the push
                        self.flow.train_ahead(step + 2)
                    with phases.phase("weight_sync"):
                        version = self.flow.push_weights(step + 1)
                    if self.flow.streaming:
                        rollout_metrics = self.flow.rollout_metrics
                step += 1
                metrics = {
                    **rollout_metrics,
                    **train_metrics,
                    **phases.times,
                    "weight_version": version,
                }
                last = step == cfg.trainer.num_steps
                if ev.sets and ((ev.interval and step % ev.interval == 0) or (last and ev.at_end)):
                    metrics.update(self._evaluate(step))
                metrics.update(self.health.metrics())
                # one flush in flight at a time (so rows stay in order), not awaited on the critical path
                self._settle_flush()
                self._flushing = self.metrics.flush.remote(step, metrics, phases.spans)
                self.last_metrics = metrics
                progress.update(step, metrics, log=step % cfg.ops.log_interval == 0)
                interval = cfg.ops.checkpoint_interval
                if interval and step % interval == 0 and step < cfg.trainer.num_steps:
                    self._save(step)
            if step > start_step or not ckpt.latest_checkpoint(self.run_dir):
                self._save(step)
            self._settle_flush()
            if self.stop_requested:
                logger.info("stopped at step %d; resume with: relax train ... --resume", step)
        finally:
            progress.close()
            try:  # a failed step: the rows of the steps before it still reach metrics.jsonl
                self._settle_flush()
            except Exception:  # noqa: BLE001 - the metrics role is gone; the step's error is raised
                logger.exception("the last metrics flush failed")
        return step

    def _may_train_ahead(self, step: int) -> bool:
        """overlap_push: whether step `step`'s update may start before the step before it is pushed. Not
        past the last step, after a stop request, nor when a checkpoint follows the step before (it
        saves the Actor as that step left it)."""
        cfg = self.cfg
        interval, before = cfg.ops.checkpoint_interval, step - 1
        saves = bool(interval) and before % interval == 0
        return self.flow.overlap and step <= cfg.trainer.num_steps and not self.stop_requested and not saves

    def _settle_flush(self) -> None:
        """Wait for the last step's metrics to be written (raising the metrics role's error)."""
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            flushing.result()

    def _evaluate(self, step: int) -> dict[str, float]:
        if self.flow is not None:
            self.flow.settle()  # the engines resumed after the last push
        times: dict[str, float] = {}
        with timer("eval", times):
            metrics = self.watchdog.wait(self.rollout.evaluate.remote(step), "rollout", "the evaluation")
        for es in self.cfg.eval.sets:  # on the console (the Rollout's own line goes to its log file)
            if (reward := metrics.get(f"eval/{es.name}/reward_mean")) is not None:
                logger.info("eval %s at step %d: reward %.3f", es.name, step, reward)
        return {**metrics, **times}

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        self.flow.settle()  # the Rollout counted the last push's step as trained
        self._settle_flush()  # metrics.jsonl holds every step the checkpoint covers
        t0 = time.perf_counter()
        d = ckpt.begin(self.run_dir, step)
        self.actor.save.remote(str(d / "actor")).result()
        self.rollout.save.remote(str(d / "rollout.json")).result()
        ckpt.finish(self.run_dir, step, {"run": self.cfg.run.name}, keep=self.cfg.ops.keep_checkpoints)
        logger.info("checkpoint step %d saved to %s (%.1fs)", step, d, time.perf_counter() - t0)

    def _restore(self, d: Path) -> None:
        try:
            self.actor.load.remote(str(d / "actor")).result()
            self.rollout.load.remote(str(d / "rollout.json")).result()
        except Exception as e:  # a broken checkpoint is not a role's failure: no global restart helps
            raise ckpt.load_failure(d, e, self.run_dir) from e
        logger.info("resumed from %s", d)

    def _run_token(self) -> None:
        """The run's secret: RELAX_RUN_TOKEN, else a fresh one; every server the run starts requires it.
        Operators find it in <run_dir>/secrets/run_token (readable by its owner only)."""
        token = os.environ.get("RELAX_RUN_TOKEN") or secrets.token_urlsafe(32)
        self.cfg.run.token = SecretStr(token)
        register_config_secrets(self.cfg)
        set_process_token(token)
        write_secret_file(self.run_dir / "secrets" / "run_token", token)

    # -- signals -----------------------------------------------------------------------------
    def _install_signal_handlers(self):
        def handler(signum, frame):
            if self.stop_requested:  # the second signal: stop now; if clean-up hangs, exit anyway
                logger.warning("%s again: stopping now", signal.Signals(signum).name)
                hard_exit = threading.Timer(HARD_EXIT_S, os._exit, args=(130,))
                hard_exit.daemon = True
                hard_exit.start()
                raise KeyboardInterrupt
            self.stop_requested = True
            self._stop_asked_at = time.monotonic()
            if self.flow is None:  # no step has run yet
                logger.warning(
                    "%s: stopping the start (send it again to stop at once)", signal.Signals(signum).name
                )
                return
            logger.warning(
                "%s: finishing the current step (at most ops.stop_grace_s=%gs), then saving a checkpoint "
                "(press Ctrl-C again to stop at once)",
                signal.Signals(signum).name,
                self.cfg.ops.stop_grace_s,
            )

        return signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, handler)
