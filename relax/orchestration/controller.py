"""The Controller owns the training loop: generate -> train (old/ref log-probs, advantages, update) ->
push weights -> evaluate, log, checkpoint. Roles are Ray Serve deployments reached through handles; no
maths and no Ray fan-out live here. The modes differ only in where a step's rollout starts: here, on
request (colocate), or ahead of training in the Rollout's background task (hybrid, fully_async;
`StepFlow`).

A run: the checks on the driver (`StartChecks.local`), Ray started once, the GPU plan made once for the
cluster's GPUs, the checks on the cluster, then attempts: the roles start (`Deployment`), the last
checkpoint is restored when resuming, and the loop trains. The HealthManager (`health.py`) restarts
stateless roles and engines in place while the loop runs; a failure that loses training state ends the
attempt and `recovery.run_with_restarts` starts another from the last checkpoint. A stop is requested
from outside (`StopRequest`: the command line's signal handler); the loop then ends after its step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from relax.config import RelaxConfig, dump_config
from relax.config.modes import overlaps_push, resolve_auto
from relax.config.paths import resolve_paths
from relax.ops.notify import Notifier
from relax.ops.trace import StepPhases
from relax.orchestration import checkpoint as ckpt
from relax.orchestration import gpus, service
from relax.orchestration.checks import StartChecks
from relax.orchestration.deployment import Deployment
from relax.orchestration.health import HealthManager
from relax.orchestration.progress import Progress
from relax.orchestration.recovery import run_with_restarts
from relax.orchestration.step_flow import POLL_S, StepFlow
from relax.orchestration.stop import StopRequest
from relax.orchestration.watchdog import Watchdog
from relax.utils.net import resolve_bind
from relax.utils.timer import timer

SUMMARY = ("rollout/reward_mean", "train/loss", "health/role_restarts", "health/engine_restarts")

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, cfg: RelaxConfig, *, resume: bool = False, stop: StopRequest | None = None) -> None:
        """`stop`: how a stop is requested from outside (the command line's signal handler); a fresh one
        when None (nothing outside asks)."""
        self.cfg = resolve_paths(cfg)  # on the driver, before any role sees a path
        self.run_dir, self.resume = cfg.run.run_dir, resume
        self.stop = stop if stop is not None else StopRequest()
        self.checks = StartChecks(self.cfg, self.stop)
        self.notifier = Notifier(cfg.ops.notify_urls, cfg.run.name)
        self.health: HealthManager | None = None  # with Ray: its heartbeat board is a Ray actor
        self.watchdog: Watchdog | None = None  # with the HealthManager: its waits watch the roles
        self.roles: Deployment | None = None  # the roles of the attempt
        self.flow: StepFlow | None = None  # the step sequencing over the attempt's roles
        self.last_metrics: dict[str, float] = {}
        self._flushing = None  # the last step's metrics flush, awaited before the next one
        self._config_written = False

    # -- life cycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `trainer.num_steps`; returns the last completed step."""
        found = ckpt.resume_point(self.run_dir, self.resume)
        self.checks.local()
        owns_ray = service.start_run_ray(self.cfg)  # once per run; True: this run started it (and stops it)
        try:
            # what is decided automatically is decided before config.yaml records what runs
            cluster_gpus = gpus.cluster_gpus()
            gpus.plan_gpus(self.cfg, cluster_gpus)
            self.checks.cluster(cluster_gpus)  # before any actor: seconds, not a hang
            resolve_auto(self.cfg)
            self.cfg.resources.bind = resolve_bind(self.cfg.resources.bind)
            service.set_run_token(self.cfg)
            self.notifier.run_started(
                found[0] if found else 0, self.cfg.trainer.num_steps, self.cfg.schedule.mode
            )
            self.health = HealthManager(self.cfg, self.notifier)
            ops = self.cfg.ops
            self.watchdog = Watchdog(ops.step_timeout_s, ops.stop_grace_s, self.stop, self.health.check_state)
            self.roles = Deployment(self.cfg, cluster_gpus, self.stop, cluster_ends_with_run=owns_ray)
            step = run_with_restarts(
                self._attempt,
                resume=self.resume,
                run_dir=self.run_dir,
                max_restarts=self.cfg.ops.max_global_restarts,
                notifier=self.notifier,
            )
        except BaseException as e:
            self.notifier.failure("the run stopped", e)
            raise
        finally:
            service.end_run(stop_ray=owns_ray)
        summary = {k: v for k, v in self.last_metrics.items() if k in SUMMARY or k.startswith("eval/")}
        self.notifier.run_ended(step, summary)
        return step

    def _attempt(self, resume: bool) -> int:
        """Start every role, restore the last checkpoint when resuming, and train; roles stop at the end."""
        found = ckpt.latest_checkpoint(self.run_dir) if resume else None
        start_step = found[0] if found else 0
        self.flow = None
        try:
            self.flow = self._start_roles(start_step if resume else None)
            if found:
                self._restore(found[1])
            if not self._config_written:  # a resume that failed to start leaves the run's record as it was
                dump_config(self.cfg, self.run_dir / "config.yaml")
                self._config_written = True
            self.flow.push_weights(start_step)  # engines start from the trainer's weights and version
            self.flow.start(start_step + 1)
            return self._train(start_step)
        except Exception as e:
            if (failure := self.health.failure_behind(e)) is None:
                raise
            raise failure from e
        finally:
            if self.flow is not None:
                self.flow.stop()
            self.roles.stop()

    def _start_roles(self, resume_step: int | None) -> StepFlow:
        """Deploy the roles, watch their heartbeats, and form the weight-sync group with the engines."""
        self.health.known.clear()
        handles = self.roles.start(resume_step)
        self.health.watch(list(handles))
        flow = StepFlow(
            self.cfg.schedule.mode,
            handles,
            self.health,
            redeploy=self.roles,
            wait=self.watchdog,
            watch=self.watchdog,
            overlap=overlaps_push(self.cfg),
        )
        self.stop.steps_begin(self.cfg.ops.stop_grace_s)
        flow.group.reform(
            self.watchdog.wait(handles["rollout"].engine_urls.remote(), "rollout", "the engine list")
        )
        return flow

    # -- the loop ----------------------------------------------------------------------------
    def _train(self, start_step: int) -> int:
        cfg, step = self.cfg, start_step
        progress = Progress(cfg.trainer.num_steps, start_step, enabled=cfg.ops.progress)
        try:
            if cfg.eval.sets and cfg.eval.before_train and step == 0:
                self._handle("metrics").flush.remote(0, self._evaluate(0)).result()
            # a stop request ends the loop once no update sent ahead (overlap_push) is left unpushed
            while step < cfg.trainer.num_steps and (not self.stop.requested or self.flow.training_ahead):
                step += 1
                metrics, phases = self._step(step)
                if self._eval_due(step):
                    metrics.update(self._evaluate(step))
                metrics.update(self.health.metrics())
                self._record(step, metrics, phases)
                progress.update(step, metrics, log=step % cfg.ops.log_interval == 0)
                if self._checkpoint_due(step):
                    self._save(step)
            if step > start_step or not ckpt.latest_checkpoint(self.run_dir):
                self._save(step)
            self._settle_flush()
            if self.stop.requested:
                logger.info("stopped at step %d; resume with: relax train ... --resume", step)
        finally:
            progress.close()
            try:  # a failed step: the rows of the steps before it still reach metrics.jsonl
                self._settle_flush()
            except Exception:  # noqa: BLE001 - the metrics role is gone; the step's error is raised
                logger.exception("the last metrics flush failed")
        return step

    def _step(self, step: int) -> tuple[dict[str, float], StepPhases]:
        """One step: rollout (colocate; the streaming modes started it ahead, gated by staleness, and
        their rollout metrics come with the push), the update, the weight push."""
        # restarts failed stateless roles; a lost Actor ends the attempt. The last step's post-train
        # checks (read during its push) count when they are recent.
        self.flow.check(max_age_s=POLL_S)
        self.watchdog.begin_step(step)
        phases = StepPhases()
        with phases.phase("step_time"):
            if not self.flow.streaming:
                with phases.phase("rollout"):
                    generated = self._handle("rollout").generate.remote(step)
                    rollout_metrics = self.watchdog.wait(generated, "rollout", "the rollout")
            with phases.phase("train"):
                train_metrics = self.flow.train(step)
            self.flow.begin_push(step, rollout_metrics=self.flow.streaming)  # first: on fully_async's chain
            if self._may_train_ahead(step + 1):  # overlap_push: the next step trains during the push
                self.flow.train_ahead(step + 1)
            with phases.phase("weight_sync"):
                version = self.flow.push_weights(step)
            if self.flow.streaming:
                rollout_metrics = self.flow.rollout_metrics
        return {**rollout_metrics, **train_metrics, **phases.times, "weight_version": version}, phases

    def _may_train_ahead(self, step: int) -> bool:
        """overlap_push: whether step `step`'s update may start before the step before it is pushed. Not
        past the last step, after a stop request, nor when a checkpoint follows the step before (it
        saves the Actor as that step left it)."""
        in_run = step <= self.cfg.trainer.num_steps
        return self.flow.overlap and in_run and not self.stop.requested and not self._checkpoint_due(step - 1)

    def _checkpoint_due(self, step: int) -> bool:
        """Every `ops.checkpoint_interval` steps; the last step's checkpoint is saved after the loop."""
        interval = self.cfg.ops.checkpoint_interval
        return bool(interval) and step % interval == 0 and step < self.cfg.trainer.num_steps

    def _eval_due(self, step: int) -> bool:
        ev = self.cfg.eval
        last = step == self.cfg.trainer.num_steps
        return bool(ev.sets) and bool((ev.interval and step % ev.interval == 0) or (last and ev.at_end))

    def _record(self, step: int, metrics: dict[str, float], phases: StepPhases) -> None:
        """One flush in flight at a time (so rows stay in order), not awaited on the critical path."""
        self._settle_flush()
        self._flushing = self._handle("metrics").flush.remote(step, metrics, phases.spans)
        self.last_metrics = metrics

    def _settle_flush(self) -> None:
        """Wait for the last step's metrics to be written (raising the metrics role's error)."""
        flushing, self._flushing = self._flushing, None
        if flushing is not None:
            flushing.result()

    def _evaluate(self, step: int) -> dict[str, float]:
        self.flow.settle()  # the engines resumed after the last push
        times: dict[str, float] = {}
        with timer("eval", times):
            evaluating = self._handle("rollout").evaluate.remote(step)
            metrics = self.watchdog.wait(evaluating, "rollout", "the evaluation")
        for es in self.cfg.eval.sets:  # on the console (the Rollout's own line goes to its log file)
            if (reward := metrics.get(f"eval/{es.name}/reward_mean")) is not None:
                logger.info("eval %s at step %d: reward %.3f", es.name, step, reward)
        return {**metrics, **times}

    def _handle(self, name: str):
        """Role `name`'s handle now (a role restarted in place has a new one)."""
        return self.roles.handles[name]

    # -- checkpoints -------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        self.flow.settle()  # the Rollout counted the last push's step as trained
        self._settle_flush()  # metrics.jsonl holds every step the checkpoint covers
        t0 = time.perf_counter()
        d = ckpt.begin(self.run_dir, step)
        self._handle("actor").save.remote(str(d / "actor")).result()
        self._handle("rollout").save.remote(str(d / "rollout.json")).result()
        ckpt.finish(self.run_dir, step, {"run": self.cfg.run.name}, keep=self.cfg.ops.keep_checkpoints)
        logger.info("checkpoint step %d saved to %s (%.1fs)", step, d, time.perf_counter() - t0)

    def _restore(self, d: Path) -> None:
        try:
            self._handle("actor").load.remote(str(d / "actor")).result()
            self._handle("rollout").load.remote(str(d / "rollout.json")).result()
        except Exception as e:  # a broken checkpoint is not a role's failure: no global restart helps
            raise ckpt.load_failure(d, e, self.run_dir) from e
        logger.info("resumed from %s", d)
