"""The Rollout role: draws prompts, generates responses on the inference engines through the router,
scores them, and streams the `Sample`s (with the weight versions that produced them) into the step's
data-plane partition: one step on request (colocate), or running ahead in a background task gated by
the staleness rule (hybrid, fully_async), with weight updates in between or during generation.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from relax.config import RelaxConfig
from relax.data.dataset import PromptSource, load_prompt_files
from relax.data.rows import samples_to_rows
from relax.data.sample import Sample
from relax.distributed.data_plane import DataPlane, PlaneClient, partition_name
from relax.engine.evaluator import Evaluator
from relax.engine.rollout_loop import RolloutLoop
from relax.engine.router import Router
from relax.engine.step_producer import StepProducer
from relax.ops.engine_recovery import EngineSupervisor
from relax.orchestration.staleness import StalenessGate
from relax.rewards import build_scorer

logger = logging.getLogger(__name__)


class RolloutRole(PlaneClient):
    def __init__(self, cfg: RelaxConfig, plane: DataPlane | None = None) -> None:
        from transformers import AutoTokenizer

        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        rows = load_prompt_files(cfg.data.train_files, cfg.data)
        self.source = PromptSource(rows, shuffle=cfg.data.shuffle, seed=cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.engine_group = None
        urls = list(cfg.rollout.engine_urls)
        engine_kwargs = {
            "dtype": cfg.model.dtype,
            "max_running": cfg.rollout.engine_max_running,
            "threads": cfg.rollout.engine_threads,
            "seed": cfg.run.seed,
        }
        if cfg.rollout.engine == "embedded":
            from relax.distributed.engine_group import EngineGroup

            self.engine_group = EngineGroup(
                cfg.model.path,
                cfg.rollout.num_engines,
                engine_kwargs,
                num_gpus=cfg.resources.engine_gpus or 0.0,
                gpu_group=cfg.resources.gpu_group,
            )
            urls = self.engine_group.urls
        self.router = Router(urls, timeout_s=cfg.rollout.request_timeout_s)
        self.engine_supervisor = None  # health hook: replaces failed embedded engines (relax.ops)
        if self.engine_group is not None:
            self.engine_supervisor = EngineSupervisor(
                self.engine_group, self.router, cfg.model.path, engine_kwargs, cfg.ops.heartbeat_interval_s
            )
        self.loop = RolloutLoop(cfg, self.tokenizer, self.router, build_scorer(cfg.reward))
        self.evaluator = Evaluator(cfg, self.loop)
        self.producer = StepProducer(cfg, self.loop, self.source)
        # connected on first use (eval-only runs have no data plane)
        self._plane, self._plane_kind = plane, cfg.resources.data_plane
        self.gate: StalenessGate | None = None
        self._ahead_task: asyncio.Task | None = None
        self._step_error: BaseException | None = None  # the first failed step running ahead
        self._metrics: dict[int, dict[str, float]] = {}  # step -> rollout metrics, until collected
        self._ahead: dict[int, int] = {}  # step -> steps ahead of training when it started
        self._source_states: dict[int, dict] = {}  # step -> prompt position before it was drawn
        self._trained = 0  # last training step whose weights the engines hold
        self.elastic, self._elastic_server = None, None
        if cfg.rollout.elastic.enabled:
            self._start_elastic(engine_kwargs)

    # -- elastic scaling (relax/ops, docs/elastic_api.md) ------------------------------------
    def _start_elastic(self, engine_kwargs: dict) -> None:
        """Serve the elastic API; needs the event loop the role's async methods run on (Serve's)."""
        from relax.ops.elastic_api import ElasticServer, record_endpoint
        from relax.ops.elastic_manager import ElasticManager

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.info("elastic API not started: the rollout runs outside an event loop")
            return
        provider = None
        with contextlib.suppress(ImportError):
            import ray

            if ray.is_initialized():
                from relax.distributed.engine_group import RayEngineProvider

                provider = RayEngineProvider(
                    self.cfg.model.path, engine_kwargs, num_gpus=self.cfg.resources.engine_gpus or 0.0
                )
        e = self.cfg.rollout.elastic
        self.elastic = ElasticManager(
            self.router,
            self.router.urls(),
            provider=provider,
            operation_timeout_s=e.operation_timeout_s,
            drain_timeout_s=e.drain_timeout_s,
            max_engines=e.max_engines,
        )
        self._elastic_server = ElasticServer(self.elastic, loop, e.host, e.port)
        record_endpoint(self.cfg.run.run_dir, "elastic_api", self._elastic_server.start())

    async def elastic_plan(self) -> list[str] | None:
        """Before a weight push: the engines the weight-sync group should have, or None if unchanged."""
        return self.elastic.plan() if self.elastic is not None else None

    async def elastic_join_failed(self, error: str) -> list[str]:
        return await self.elastic.join_failed(error)

    async def elastic_group_formed(self, urls: list[str]) -> None:
        await self.elastic.group_formed(urls)

    async def elastic_pushed(self, version: int) -> None:
        await self.elastic.pushed(version)

    def engine_urls(self) -> list[str]:
        return self.router.urls()

    # -- training rollout: one step now (colocate) or running ahead (hybrid, fully_async) -----------
    async def generate(self, step: int) -> dict[str, float]:
        """Generate step `step` into its data-plane partition; returns its rollout metrics."""
        self._source_states[step] = self.source.state_dict()  # the data position before this step
        partition = partition_name(step)

        async def sink(group: list[Sample]) -> None:
            contexts = self.cfg.rollout.agent.contexts_per_sample
            await self.plane.put_rows(partition, samples_to_rows(group, contexts))

        metrics = await self.producer.produce(step, sink)
        self._metrics[step] = metrics
        return metrics

    async def start(self, first_step: int) -> None:
        """Run ahead from `first_step` in the background, gated by the staleness rule."""
        self.gate = StalenessGate(self.cfg.resources.max_staleness, first_step)
        self._ahead_task = asyncio.create_task(self._run_ahead(first_step))

    async def _run_ahead(self, step: int) -> None:
        """Start each step as soon as the staleness gate lets it, without waiting for the previous step's
        slowest samples: the engines fill their batch with step s + 1's prompts while step s's long tail
        decodes, so a step costs the engines' throughput rather than its longest response (the gate alone
        bounds staleness, which counts from a sample's start). Overlapping steps draw prompts in turn, so
        with dynamic sampling a step's extra rounds may come after the next step's first draw; a resume
        then draws those few prompts again (none is skipped)."""
        steps: set[asyncio.Task] = set()
        try:
            while step <= self.cfg.trainer.num_steps and self._step_error is None:
                ahead = await self.gate.wait_until_may_start(step)
                self._ahead[step] = ahead
                task = asyncio.create_task(self.generate(step), name=f"rollout-step-{step}")
                task.add_done_callback(self._step_done)
                steps.add(task)
                step += 1
                await asyncio.sleep(0)  # the new step draws its prompts before the next one may start
                steps = {t for t in steps if not t.done()}
            if steps:
                await asyncio.wait(steps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in steps:
                t.cancel()

    def _step_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._step_error is None:
            self._step_error = task.exception()

    def _failure(self) -> BaseException | None:
        """The first failure of a running-ahead step (or of the loop that starts them)."""
        if self._step_error is not None:
            return self._step_error
        task = self._ahead_task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def metrics(self, step: int) -> dict[str, float]:
        """Wait until the background rollout finished step `step`; its metrics (re-raises its failure)."""
        while step not in self._metrics:
            if (err := self._failure()) is not None:
                raise err
            if self._ahead_task is None or self._ahead_task.done():
                raise RuntimeError(f"rollout is not running ahead; step {step} will never be generated")
            await asyncio.sleep(0.01)
        return {**self._metrics.pop(step), "staleness/rollout_ahead": float(self._ahead.pop(step, 0))}

    async def check(self) -> None:
        """Raise the background rollout's failure, if it failed."""
        if (err := self._failure()) is not None:
            raise err

    async def begin_weight_update(self) -> None:
        """Before a weight push: abort (partial rollout) or wait for in-flight generation."""
        await self.loop.inflight.begin_update()

    async def end_weight_update(self, trained_step: int) -> None:
        """After the push of training step `trained_step`'s weights: generation continues, and the
        staleness gate counts that step as consumed."""
        self.loop.inflight.end_update()
        if self.gate is not None:
            await self.gate.mark_consumed(trained_step)
        self._trained = trained_step
        for s in [s for s in self._source_states if s <= trained_step]:
            self._source_states.pop(s)

    async def stop(self) -> None:
        if self._ahead_task is not None:
            self._ahead_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._ahead_task
            self._ahead_task = None

    async def evaluate(self, step: int, out_dir: str | None = None) -> dict[str, float]:
        """Evaluate every configured held-out set on the engines' current weights; response samples go
        to `out_dir` (default `<run_dir>/eval`)."""
        return await self.evaluator.evaluate(step, Path(out_dir or self.cfg.run.run_dir / "eval"))

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """The data position of training: prompts of steps generated ahead are not counted."""
        state = self._source_states.get(self._trained + 1, self.source.state_dict())
        Path(path).write_text(json.dumps({"source": state}))

    def load(self, path: str) -> None:
        self.source.load_state_dict(json.loads(Path(path).read_text())["source"])

    # -- health hook: engine replacement before a weight push (relax/ops/engine_recovery.py) ------
    async def replace_dead_engines(self) -> dict:
        """Replace failed engines; `urls` is the weight-sync group to form, `replaced` how many."""
        if self.engine_supervisor is None:
            return {"urls": self.router.urls(), "replaced": 0}
        return await self.engine_supervisor.replace_dead()

    def admit_engines(self) -> list[str]:
        """Replacement engines that received the current weights start taking requests."""
        return self.engine_supervisor.admit() if self.engine_supervisor is not None else []

    async def stop_engines(self) -> None:
        await self.stop()
        if self._elastic_server is not None:
            self._elastic_server.stop()
            self._elastic_server = None
        if self.elastic is not None:
            await self.elastic.close()
            self.elastic = None
        if self.engine_supervisor is not None:
            self.engine_supervisor.stop()
        self.loop.close()
        await self.router.close()
        if self.engine_group is not None:
            await asyncio.to_thread(self.engine_group.stop)
            self.engine_group = None
