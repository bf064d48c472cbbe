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

from relax.agentic.rollout import agent_factory
from relax.config import RelaxConfig
from relax.config.modes import groups_per_put
from relax.data.columns import partition_name
from relax.data.dataset import PromptSource, load_prompt_files
from relax.data.rows import samples_to_rows
from relax.data.sample import Sample
from relax.dataplane.plane import DataPlane, PlaneClient, RowWriter
from relax.ops.engine_recovery import EngineSupervisor
from relax.rewards import build_scorer
from relax.rollout.evaluator import Evaluator
from relax.rollout.loop import RolloutLoop
from relax.rollout.router import Router
from relax.rollout.staleness import StalenessGate
from relax.rollout.step_assembler import StepAssembler
from relax.rollout.step_producer import StepProducer

logger = logging.getLogger(__name__)


async def _none() -> None:
    return None


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
            from relax.backends.inference.engine_actors import EngineGroup

            self.engine_group = EngineGroup(
                cfg.model.path,
                cfg.rollout.num_engines,
                engine_kwargs,
                num_gpus=cfg.resources.engine_gpus or 0.0,
                gpu_group=cfg.resources.gpu_group,
                cpus=cfg.resources.rollout_cpus,
            )
            urls = self.engine_group.urls
        self.router = Router(urls, timeout_s=cfg.rollout.request_timeout_s)
        self.engine_supervisor = None  # health hook: replaces failed embedded engines (relax.ops)
        if self.engine_group is not None:
            self.engine_supervisor = EngineSupervisor(
                self.engine_group, self.router, cfg.model.path, engine_kwargs, cfg.ops.heartbeat_interval_s
            )
        self.loop = RolloutLoop(
            cfg, self.tokenizer, self.router, build_scorer(cfg.reward), agent_factory(cfg, self.tokenizer)
        )
        self.evaluator = Evaluator(cfg, self.loop)
        self.producer = StepProducer(cfg, self.loop, self.source)
        self.assembler = StepAssembler(
            cfg.rollout.prompts_per_step, cfg.rollout.batch_order, self._write, cfg.rollout.over_provision
        )
        self._writer: RowWriter | None = None  # groups finished together go out in one put
        # connected on first use (eval-only runs have no data plane)
        self._plane, self._plane_kind = plane, cfg.schedule.data_plane
        self.gate: StalenessGate | None = None
        self._ahead_task: asyncio.Task | None = None
        self._step_error: BaseException | None = None  # the first failed step running ahead
        self._finished: set[int] = set()  # steps whose producer wrote all its groups
        self._ahead: dict[int, int] = {}  # step -> steps ahead of training when it started
        self._source_states: dict[int, dict] = {}  # step -> prompt position before it was drawn
        self._targets: dict[int, set[int]] = {}  # producer step -> steps its groups went to
        self._produced: dict[int, dict[str, float]] = {}  # finished producer step -> its own metrics
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
                from relax.backends.inference.engine_actors import RayEngineProvider

                provider = RayEngineProvider(
                    self.cfg.model.path,
                    engine_kwargs,
                    num_gpus=self.cfg.resources.engine_gpus or 0.0,
                    cpus=self.cfg.resources.rollout_cpus,
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
    async def _write(self, step: int, group: list[Sample]) -> None:
        contexts = self.cfg.rollout.agent.contexts_per_sample
        if self._writer is None:
            r = self.cfg.rollout
            self._writer = RowWriter(self.plane, groups_per_put(self.cfg), r.prompts_per_step)
        await self._writer.write(partition_name(step), samples_to_rows(group, contexts))

    async def generate(self, step: int) -> dict[str, float]:
        """Generate step `step` into its data-plane partition; returns its rollout metrics."""
        await self._produce(step)
        return await self.metrics(step)

    async def _produce(self, step: int) -> None:
        """Draw step `step`'s prompts and write its groups, each where `rollout.batch_order` sends it."""
        self._source_states[step] = self.source.state_dict()  # the data position before this step
        self._targets[step] = set()
        self.assembler.open(step)

        async def sink(group: list[Sample], stats: object) -> None:
            self._targets[step].add(await self.assembler.put(step, group, stats))

        self._produced[step] = await self.producer.produce(step, sink, self.assembler.quota())
        self._finished.add(step)

    def _ready(self, step: int) -> bool:
        if self.assembler.order == "step":
            return step in self._produced
        return self.assembler.is_complete(step)

    def _collect(self, step: int) -> dict[str, float]:
        """Step order: the producer's metrics; completion order: metrics of the groups the step trains
        on, with the dynamic-sampling figures of the latest finished producer."""
        if self.assembler.order == "step":
            self.assembler.steps.pop(step, None)
            return self._produced.pop(step)
        metrics = self.assembler.collect(step)
        done = [s for s in self._produced if s <= step]
        if done:
            extra = self._produced[max(done)]
            metrics.update({k: v for k, v in extra.items() if k.startswith("rollout/ds_")})
            for s in done:
                self._produced.pop(s)
        metrics["rollout/aborted_requests"] = float(self.loop.inflight.num_aborted)
        return metrics

    async def start(self, first_step: int) -> None:
        """Run ahead from `first_step` in the background, gated by the staleness rule."""
        self.gate = StalenessGate(self.cfg.schedule.max_staleness, first_step)
        if sleep := self.cfg.schedule.debug_engine_step_sleep_s:
            await asyncio.gather(*(e.client.slow_down(sleep) for e in self.router.engines.values()))
        self._ahead_task = asyncio.create_task(self._run_ahead(first_step))

    async def _run_ahead(self, step: int) -> None:
        """Start each step as soon as the staleness gate lets it, without waiting for the previous step's
        slowest samples: the engines fill their batch with step s + 1's prompts while step s's long tail
        decodes. With `rollout.batch_order: step` step s is still complete only when its longest response
        ends; with `completion` it takes the first groups to finish, so it costs the engines' throughput
        instead. Overlapping steps draw prompts in turn; a resume draws again the prompts of groups not yet
        trained (none is skipped).
        """
        steps: set[asyncio.Task] = set()
        try:
            while step <= self.cfg.trainer.num_steps and self._step_error is None:
                ahead = await self.gate.wait_until_may_start(step)
                self._ahead[step] = ahead
                task = asyncio.create_task(self._produce(step), name=f"rollout-step-{step}")
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
        """Wait until step `step`'s data is complete; its rollout metrics (re-raises a running-ahead
        step's failure)."""
        while not self._ready(step):
            if (err := self._failure()) is not None:
                raise err
            if step not in self.assembler.steps and (self._ahead_task is None or self._ahead_task.done()):
                raise RuntimeError(f"rollout is not running ahead; step {step} will never be generated")
            await asyncio.sleep(0.01)
        return {**self._collect(step), "staleness/rollout_ahead": float(self._ahead.pop(step, 0))}

    async def check(self) -> None:
        """Raise the background rollout's failure, if it failed."""
        if (err := self._failure()) is not None:
            raise err

    async def prepare_weight_update(self, replace_dead: bool, metrics_step: int | None = None) -> dict:
        """`begin_weight_update`, then `elastic_plan`, then (only when the plan is None, and with
        `replace_dead`) `replace_dead_engines`, in one call: the driver's usual push takes three round
        trips (prepare, push, finish) instead of six (~8 ms each on 2 CPU cores).
        A failure of the running-ahead rollout is raised first (so the driver needs no separate
        `check` between an update and its push). Stopping generation and checking the engines run at
        once: both wait on the engines (the aborted requests' answers; a /health probe), and the push
        waits for both (22 -> 12 ms a push on 2 CPU cores).
        `metrics_step` (streaming modes, the step just trained): its rollout metrics come back too, one
        Serve call a step less than a separate `metrics` call. They are read before generation stops: a
        trained step's data is complete, so this does not wait, and nothing it reads waits on a push.
        Returns {"plan": elastic_plan's answer, "replaced": replace_dead_engines' answer or None,
        "metrics": the step's rollout metrics (empty without `metrics_step`)}."""
        await self.check()
        metrics = await self.metrics(metrics_step) if metrics_step is not None else {}
        plan = await self.elastic_plan()
        checking = replace_dead and plan is None
        _, replaced = await asyncio.gather(
            self.begin_weight_update(), self.replace_dead_engines() if checking else _none()
        )
        return {"plan": plan, "replaced": replaced, "metrics": metrics}

    async def finish_weight_update(self, trained_step: int, admit: bool) -> list[str]:
        """`admit_engines` (after a push that reached them) and `end_weight_update`, in one call."""
        admitted = self.admit_engines() if admit else []
        await self.end_weight_update(trained_step)
        return admitted

    async def begin_weight_update(self) -> None:
        """Before a weight push: abort (partial rollout) or wait for in-flight generation."""
        await self.loop.inflight.begin_update()

    async def end_weight_update(self, trained_step: int) -> None:
        """After the push of training step `trained_step`'s weights: generation continues, and the
        staleness gate counts that step as consumed."""
        await self.loop.inflight.end_update()
        if self.gate is not None:
            await self.gate.mark_consumed(trained_step)
        self._trained = trained_step
        for s in [s for s in self._source_states if self._settled(s)]:
            self._source_states.pop(s)
            self._targets.pop(s, None)
            self._finished.discard(s)

    def _settled(self, step: int) -> bool:
        """Every group step `step`'s producer drew is written and trained."""
        targets = self._targets.get(step)
        return step in self._finished and max(targets or {step}) <= self._trained

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
        pending = [s for s in self._source_states if not self._settled(s)]
        state = self._source_states[min(pending)] if pending else self.source.state_dict()
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
