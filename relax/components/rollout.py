"""The Rollout role: draws prompts, generates responses on the inference engines through the router,
scores them, and hands back `Sample`s that carry the weight version that produced them.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from relax.config import RelaxConfig
from relax.data.dataset import PromptSource, load_prompts
from relax.data.sample import Sample
from relax.engine.evaluator import Evaluator
from relax.engine.rollout_loop import RolloutLoop
from relax.engine.router import Router
from relax.rewards import build_scorer

logger = logging.getLogger(__name__)


@dataclass
class RolloutResult:
    samples: list[Sample]  # n_samples_per_prompt per prompt, grouped by group_id
    metrics: dict[str, float]  # rollout/* and reward/* metrics of this step


class RolloutRole:
    def __init__(self, cfg: RelaxConfig) -> None:
        from transformers import AutoTokenizer

        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        d = cfg.data
        rows = []
        for f in d.train_files:
            rows += load_prompts(
                f,
                prompt_key=d.prompt_key,
                messages_key=d.messages_key,
                label_key=d.label_key,
                metadata_key=d.metadata_key,
            )
        self.source = PromptSource(rows, shuffle=d.shuffle, seed=cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.engine_group = None
        urls = list(cfg.rollout.engine_urls)
        if cfg.rollout.engine == "embedded":
            from relax.distributed.engine_group import EngineGroup

            engine_kwargs = {
                "dtype": cfg.model.dtype,
                "max_running": cfg.rollout.engine_max_running,
                "threads": cfg.rollout.engine_threads,
                "seed": cfg.run.seed,
            }
            self.engine_group = EngineGroup(cfg.model.path, cfg.rollout.num_engines, engine_kwargs)
            urls = self.engine_group.urls
        self.router = Router(urls, timeout_s=cfg.rollout.request_timeout_s)
        self.loop = RolloutLoop(cfg, self.tokenizer, self.router, build_scorer(cfg.reward))
        self.evaluator = Evaluator(cfg, self.loop)

    def engine_urls(self) -> list[str]:
        return self.router.urls()

    async def generate(self, step: int) -> RolloutResult:
        rows = self.source.next_batch(self.cfg.rollout.prompts_per_step)
        samples, metrics = await self.loop.run(rows, step)
        return RolloutResult(samples, metrics)

    async def evaluate(self, step: int, out_dir: str | None = None) -> dict[str, float]:
        """Evaluate every configured held-out set on the engines' current weights; response samples go
        to `out_dir` (default `<run_dir>/eval`)."""
        return await self.evaluator.evaluate(step, Path(out_dir or self.cfg.run.run_dir / "eval"))

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str) -> None:
        Path(path).write_text(json.dumps({"source": self.source.state_dict()}))

    def load(self, path: str) -> None:
        self.source.load_state_dict(json.loads(Path(path).read_text())["source"])

    async def stop_engines(self) -> None:
        await self.router.close()
        if self.engine_group is not None:
            await asyncio.to_thread(self.engine_group.stop)
            self.engine_group = None
