"""The GenRM role: an LLM-as-judge reward service with its own inference engines.

Deployed as its own Serve application ``genrm`` when ``reward.genrm`` is set
(``relax.orchestration.registry.roles_for``); the ``genrm`` reward (``relax/rewards/genrm.py``)
calls ``judge`` by handle from the Rollout replica or a reward-pool worker.

Per request: render the judge prompt of every item from ``GenRMConfig.prompt_template``, wrap it in the
judge tokenizer's chat template, and hand the token ids to a ``MicroBatcher`` that gathers concurrent
requests into one ``/generate`` with a batch of prompts (greedy, at most ``max_batch_size`` prompts);
then parse each answer's verdict (strict; an answer without one gets ``unparsed_score`` and is counted).

The judge engines are embedded engines started by this role (``EngineGroup``), or any engines that speak
the protocol (embedded or SGLang) attached by ``engine_urls``. A plain class: tests construct it directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from relax.config import RelaxConfig
from relax.data.dataset import tokenize_prompt
from relax.rewards.genrm import GenRMConfig, JudgeResult, parse_verdict, render_judge_prompt
from relax.rollout.router import Router
from relax.utils.microbatch import MicroBatcher
from relax.utils.placement import ray_placement

logger = logging.getLogger(__name__)


class GenRMRole:
    """Judges (question, response, reference) items with an LLM; see the module docstring."""

    def __init__(self, cfg: RelaxConfig | GenRMConfig) -> None:
        from transformers import AutoTokenizer

        from relax.utils.logging import setup_logging

        setup_logging()
        g = cfg if isinstance(cfg, GenRMConfig) else cfg.reward.genrm
        bind = "auto" if isinstance(cfg, GenRMConfig) else cfg.resources.bind
        if g is None:
            raise ValueError("the GenRM role needs reward.genrm (set reward.genrm.model_path)")
        self.cfg = g
        self.tokenizer = AutoTokenizer.from_pretrained(g.model_path)
        self.stop_token_ids = sorted(
            {
                t
                for t in (self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
                if isinstance(t, int) and t >= 0
            }
        )
        self.engine_group: Any = None
        urls = list(g.engine_urls)
        if not urls:
            from relax.backends.inference.engine_actors import EngineGroup

            engine_kwargs = {
                "dtype": g.dtype,
                "max_running": g.engine_max_running,
                "threads": g.engine_threads,
                "seed": 0,
            }
            self.engine_group = EngineGroup(
                g.model_path,
                g.num_engines,
                engine_kwargs,
                num_cpus=g.engine_cpus,
                bind=bind,
                placement={} if isinstance(cfg, GenRMConfig) else ray_placement(cfg, "engines"),
            )
            urls = self.engine_group.urls
        self.router = Router(urls, timeout_s=g.request_timeout_s)
        self.batcher: MicroBatcher[list[int], str] = MicroBatcher(
            self._generate, g.max_batch_size, g.batch_wait_s
        )
        # running totals since start: judged items, unparsed answers, engine batches, latency
        self.totals = {"calls": 0, "unparsed": 0, "batches": 0, "latency_sum_s": 0.0, "requests": 0}

    # -- prompts ---------------------------------------------------------------------------------
    def prompt_ids(self, item: dict[str, Any]) -> list[int]:
        """Token ids of the judge prompt for one item (``question``, ``response``, ``reference``)."""
        text = render_judge_prompt(
            self.cfg.prompt_template,
            item.get("question", ""),
            item.get("response", ""),
            item.get("reference"),
        )
        return tokenize_prompt(self.tokenizer, text, self.cfg.apply_chat_template, self.cfg.system_prompt)

    def sampling_params(self) -> dict[str, Any]:
        """Greedy decoding of a short verdict, stopping at the end of the assistant turn."""
        return {
            "n": 1,
            "max_new_tokens": self.cfg.max_new_tokens,
            "temperature": 0.0,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": True,
        }

    # -- serving ---------------------------------------------------------------------------------
    async def judge(self, items: list[dict[str, Any]]) -> JudgeResult:
        """Scores and verdicts of ``items``, in order; batched with concurrent requests."""
        start = time.perf_counter()
        prompts = [self.prompt_ids(item) for item in items]
        texts = await self.batcher.submit(prompts)
        latency = time.perf_counter() - start
        verdicts = [parse_verdict(t, self.cfg.verdict_pattern, self.cfg.verdict_scores) for t in texts]
        scores = [self.cfg.unparsed_score if v is None else self.cfg.verdict_scores[v] for v in verdicts]
        unparsed = [t for t, v in zip(texts, verdicts, strict=True) if v is None]
        if unparsed:
            logger.warning(
                "genrm: %d of %d judge answers have no verdict; score := %s (first: %r)",
                len(unparsed), len(texts), self.cfg.unparsed_score, unparsed[0][:200],
            )  # fmt: skip
        self.totals["calls"] += len(items)
        self.totals["unparsed"] += len(unparsed)
        self.totals["requests"] += 1
        self.totals["latency_sum_s"] += latency
        return JudgeResult(scores=scores, verdicts=verdicts, latency_s=latency, texts=texts)

    async def _generate(self, prompts: list[list[int]]) -> list[str]:
        """One ``/generate`` with a batch of prompts; the decoded answers in order."""
        outputs = await self.router.generate(prompts, self.sampling_params(), return_logprob=False)
        outputs = outputs if isinstance(outputs, list) else [outputs]
        self.totals["batches"] += 1
        return [o.text or self.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outputs]

    def metrics(self) -> dict[str, float]:
        """Totals since the role started: ``genrm/calls`` (items judged), ``genrm/unparsed``,
        ``genrm/batches`` (engine calls) and ``genrm/latency_mean_s`` (per request)."""
        t = self.totals
        return {
            "genrm/calls": float(t["calls"]),
            "genrm/unparsed": float(t["unparsed"]),
            "genrm/batches": float(t["batches"]),
            "genrm/latency_mean_s": t["latency_sum_s"] / t["requests"] if t["requests"] else 0.0,
        }

    def engine_urls(self) -> list[str]:
        return self.router.urls()

    async def stop_engines(self) -> None:
        """Close the router and stop the engines this role started (attached engines are left running)."""
        await self.router.close()
        if self.engine_group is not None:
            await asyncio.to_thread(self.engine_group.stop)
            self.engine_group = None

    def __del__(self) -> None:
        # Serve calls __del__ when it shuts the replica down; the engine actors would die with the
        # replica anyway (their owner), this only ends them sooner.
        group = getattr(self, "engine_group", None)
        if group is not None:
            try:
                group.stop()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("genrm: stopping the judge engines failed")
            self.engine_group = None
