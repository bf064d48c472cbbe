"""The Rollout role: draws prompts, generates responses on the inference engines, scores them, and
streams the `Sample`s (with the weight versions that produced them) into the step's data-plane
partition: one step on request (colocate), or running ahead in a background task gated by the staleness
rule (hybrid, fully_async), with weight updates in between or during generation.

A façade over four parts: the engine fleet (`relax.fleet.fleet`: engines, router, replacement, elastic
API), the rollout loop and its step producer/assembler (`relax.rollout`), the step ledger
(`relax.rollout.ledger`: what is drawn, written and trained) and the staleness gate. A plain class: Ray
Serve deploys it (`relax.orchestration.service`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from relax.agentic.rollout import agent_factory
from relax.config import RelaxConfig
from relax.config.modes import groups_per_put
from relax.data.columns import partition_name
from relax.data.dataset import PromptSource
from relax.data.overlong import DROPPED_METRIC, load_checked
from relax.data.rows import samples_to_rows
from relax.data.sample import Sample
from relax.dataplane.plane import DataPlane, PlaneClient, RowWriter
from relax.engine_api.protocol import version_to_engine
from relax.fleet.fleet import EngineFleet
from relax.rewards import build_scorer
from relax.rollout.engine_stats import EngineStats
from relax.rollout.evaluator import Evaluator
from relax.rollout.ledger import StepLedger
from relax.rollout.loop import RolloutLoop
from relax.rollout.staleness import StalenessGate
from relax.rollout.step_assembler import StepAssembler
from relax.rollout.step_producer import StepProducer
from relax.utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


async def _none() -> None:
    return None


class RolloutRole(PlaneClient):
    def __init__(self, cfg: RelaxConfig, plane: DataPlane | None = None) -> None:
        from transformers import AutoTokenizer

        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        # overlong prompts are dropped (or refused) here, before the first step, never during one
        rows, dropped = load_checked(cfg.data.train_files, cfg.data, self.tokenizer, "data.train_files")
        if dropped:  # the driver's preflight warned, naming them
            logger.info("dropped %d prompt(s) longer than data.max_prompt_len", len(dropped))
        self.dropped_overlong = len(dropped)
        self.source = PromptSource(rows, shuffle=cfg.data.shuffle, seed=cfg.run.seed)
        self.fleet = EngineFleet(cfg)
        self.router = self.fleet.router
        self.engine_stats = EngineStats()
        scorer = build_scorer(cfg.reward)
        self.loop = RolloutLoop(cfg, self.tokenizer, self.router, scorer, agent_factory(cfg, self.tokenizer))
        self.evaluator = Evaluator(cfg, self.loop)
        self.producer = StepProducer(cfg, self.loop, self.source)
        r = cfg.rollout
        self.assembler = StepAssembler(r.prompts_per_step, r.batch_order, self._write, r.over_provision)
        self.ledger = StepLedger(self.assembler)
        self._writer: RowWriter | None = None  # groups finished together go out in one put
        self._use_plane(plane, cfg.schedule.data_plane)  # connected on first use (eval-only runs have none)
        self.gate: StalenessGate | None = None
        self._ahead_task: asyncio.Task | None = None
        self._step_error: BaseException | None = None  # the first failed step running ahead
        if cfg.rollout.elastic.enabled and (url := self.fleet.start_elastic()) is not None:
            from relax.fleet.elastic_api import record_endpoint

            record_endpoint(cfg.run.run_dir, "elastic_api", url)

    # -- engines (relax/fleet/fleet.py): the weight push's questions ------------------------------
    def engine_urls(self) -> list[str]:
        return self.fleet.urls()

    async def elastic_plan(self) -> list[str] | None:
        """Before a weight push: the engines the weight-sync group should have, or None if unchanged."""
        return self.fleet.plan()

    async def elastic_join_failed(self, error: str) -> list[str]:
        return await self.fleet.elastic.join_failed(error)

    async def elastic_group_formed(self, urls: list[str]) -> None:
        await self.fleet.elastic.group_formed(urls)

    async def elastic_pushed(self, version: int) -> None:
        await self.fleet.elastic.pushed(version)

    async def replace_dead_engines(self) -> dict:
        """Replace failed engines; `urls` is the weight-sync group to form, `replaced` how many."""
        return await self.fleet.replace_dead()

    def admit_engines(self) -> list[str]:
        """Replacement engines that received the current weights start taking requests."""
        return self.fleet.admit()

    # -- training rollout: one step now (colocate) or running ahead (hybrid, fully_async) -----------
    async def _write(self, step: int, group: list[Sample]) -> None:
        contexts = self.cfg.rollout.agent.contexts_per_sample
        if self._writer is None:
            self._writer = RowWriter(self.plane, groups_per_put(self.cfg), self.cfg.rollout.prompts_per_step)
        await self._writer.write(partition_name(step), samples_to_rows(group, contexts))

    async def generate(self, step: int) -> dict[str, float]:
        """Generate step `step` into its data-plane partition; returns its rollout metrics."""
        await self._produce(step)
        return await self.metrics(step)

    async def _produce(self, step: int) -> None:
        """Draw step `step`'s prompts and write its groups, each where `rollout.batch_order` sends it."""
        self.ledger.open(step, self.source.state_dict())

        async def sink(group: list[Sample], stats: object) -> None:
            self.ledger.wrote(step, await self.assembler.put(step, group, stats))

        self.ledger.finish(step, await self.producer.produce(step, sink, self.assembler.quota()))

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
                self.ledger.ahead[step] = await self.gate.wait_until_may_start(step)
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
        while not self.ledger.ready(step):
            if (err := self._failure()) is not None:
                raise err
            if step not in self.assembler.steps and (self._ahead_task is None or self._ahead_task.done()):
                raise RuntimeError(f"rollout is not running ahead; step {step} will never be generated")
            await asyncio.sleep(0.01)
        extra = {
            "rollout/aborted_requests": float(self.loop.inflight.num_aborted),
            DROPPED_METRIC: float(self.dropped_overlong),
        }
        metrics = self.ledger.collect(step, extra)
        # the engines' prefix-cache hits and preemptions since the last step's figures, in either order
        engines = [(e.url, e.client) for e in self.router.engines.values()]
        metrics.update(await self.engine_stats.step_metrics(engines))
        return metrics

    async def check(self) -> None:
        """Raise the background rollout's failure, if it failed."""
        if (err := self._failure()) is not None:
            raise err

    # -- the weight push (relax/orchestration/weight_push.py) ----------------------------------
    async def prepare_weight_update(self, replace_dead: bool, metrics_step: int | None = None) -> dict:
        """The push's first call: raise the running-ahead rollout's failure, then `elastic_plan`,
        `begin_weight_update` and (only when the plan is None, and with `replace_dead`)
        `replace_dead_engines`, in one Serve call instead of several. Stopping generation and checking
        the engines run at once: both wait on the engines, and the push waits for both.
        `metrics_step` (streaming modes, the step just trained): its rollout metrics come back too. They
        are read before generation stops: a trained step's data is complete, so this does not wait.
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

    async def finish_weight_update(
        self, trained_step: int, admit: bool, version: int | None = None
    ) -> list[str]:
        """The push's last call: `admit_engines` (after a push that reached them), then
        `end_weight_update`. `version`: the weight version the push delivered (None: it failed), which
        the elastic API reports as the current one."""
        if version is not None and self.fleet.elastic is not None:
            self.fleet.elastic.version = version_to_engine(version)
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
        self.ledger.mark_trained(trained_step)

    async def stop(self) -> None:
        task, self._ahead_task = self._ahead_task, None
        await cancel_and_wait(task)

    async def evaluate(self, step: int, out_dir: str | None = None) -> dict[str, float]:
        """Evaluate every configured held-out set on the engines' current weights; response samples go
        to `out_dir` (default `<run_dir>/eval`)."""
        return await self.evaluator.evaluate(step, Path(out_dir or self.cfg.run.run_dir / "eval"))

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """The data position of training: prompts of steps generated ahead are not counted."""
        state = self.ledger.data_position(self.source.state_dict())
        Path(path).write_text(json.dumps({"source": state}))

    def load(self, path: str) -> None:
        self.source.load_state_dict(json.loads(Path(path).read_text())["source"])

    async def stop_engines(self) -> None:
        await self.stop()
        self.loop.close()
        await self.fleet.close()
