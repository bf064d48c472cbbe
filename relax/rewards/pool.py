"""Scoring off the rollout's critical path: a pool of Ray worker processes, each hosting a ``RewardScorer``.

``PooledRewardScorer`` has the interface of ``RewardScorer`` (``await score(samples) -> RewardStats``)
and is what ``relax.rewards.build_scorer`` returns when ``RewardConfig.num_workers > 0``. Reward
functions then run in other processes, so slow or CPU-heavy rewards (math verification, remote calls,
a GenRM judge) neither hold the rollout's event loop nor its GIL.

* **Groups stay whole**: samples are split between workers by ``group_id``, so a group reward sees all
  samples of its prompt; each worker gets one chunk per ``score`` call, balanced by sample count.
* **Concurrency limit**: ``RewardConfig.max_concurrency`` holds for the whole pool — each worker runs at
  most ``max(1, max_concurrency // num_workers)`` reward calls at once (across concurrent ``score``
  calls too).
* **Failures**: inside a worker, a reward that raises or times out is logged with its samples' ids and
  scored with ``fallback_reward`` (``RewardScorer``); a worker that dies gives its whole chunk the
  fallback, counted as failures, and is replaced by a fresh worker. Only a missing package (``ImportError``) is
  raised: it is a setup error. Failed sample ids are in ``RewardStats.failed`` and logged here too.

Only the picklable ``RewardConfig`` travels to the workers; each builds its scorer inside (STYLE 9).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from relax.data.sample import Sample
from relax.rewards.config import RewardConfig
from relax.rewards.scorer import RewardScorer, RewardStats, sample_ref

logger = logging.getLogger(__name__)

ScoredRow = tuple[float | None, dict[str, float]]  # (reward, reward_info) of one sample


@ray.remote(max_restarts=0, max_task_retries=0)
class RewardWorker:
    """One pool worker: a ``RewardScorer`` in its own process (an async actor; calls interleave)."""

    def __init__(self, cfg: RewardConfig) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        self.scorer = RewardScorer(cfg)

    async def score(self, samples: list[Sample]) -> tuple[list[ScoredRow], RewardStats]:
        """Score ``samples`` (copies of the caller's); return their rewards in order and the stats."""
        stats = await self.scorer.score(samples)
        return [(s.reward, s.reward_info) for s in samples], stats


def split_by_group(samples: list[Sample], n: int) -> list[list[int]]:
    """Indices of ``samples`` in at most ``n`` chunks: whole ``group_id`` groups, largest first onto the
    chunk with the fewest samples so far. Empty chunks are dropped."""
    groups: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample.group_id, []).append(i)
    chunks: list[list[int]] = [[] for _ in range(max(1, n))]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(members)
    return [sorted(c) for c in chunks if c]


class PooledRewardScorer:
    """``RewardScorer``'s interface over ``cfg.num_workers`` Ray worker processes (started on first use)."""

    def __init__(self, cfg: RewardConfig) -> None:
        if cfg.num_workers < 1:
            raise ValueError("PooledRewardScorer needs reward.num_workers >= 1 (0 scores in process)")
        self.cfg = cfg
        self.per_worker = max(1, cfg.max_concurrency // cfg.num_workers)
        self._workers: list[Any] | None = None

    # -- pickling: only the config travels; workers are started again where it lands --
    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"])  # type: ignore[misc]

    def _new_worker(self) -> Any:
        worker_cfg = self.cfg.model_copy(update={"num_workers": 0, "max_concurrency": self.per_worker})
        return RewardWorker.options(num_cpus=self.cfg.worker_cpus).remote(worker_cfg)

    def workers(self) -> list[Any]:
        """The worker actors, started on the first call."""
        if self._workers is None:
            self._workers = [self._new_worker() for _ in range(self.cfg.num_workers)]
            logger.info(
                "reward pool: %d workers, at most %d reward calls in flight each",
                self.cfg.num_workers, self.per_worker,
            )  # fmt: skip
        return self._workers

    def close(self) -> None:
        """End the worker processes."""
        for worker in self._workers or []:
            ray.kill(worker)
        self._workers = None

    async def score(self, samples: list[Sample]) -> RewardStats:
        """Fill ``reward`` and ``reward_info`` of every sample through the pool; return the merged stats."""
        if not samples:
            return RewardStats()
        chunks = split_by_group(samples, len(self.workers()))
        parts = await asyncio.gather(
            *(self._score_chunk(w, [samples[i] for i in c]) for w, c in enumerate(chunks))
        )
        stats = RewardStats()
        for part in parts:
            stats = stats.merge(part)
        if stats.failed:
            logger.warning(
                "reward pool: %d of %d samples got the fallback reward %s (index/sample_id): %s",
                len(stats.failed), len(samples), self.cfg.fallback_reward, stats.failed,
            )  # fmt: skip
        return stats

    async def _score_chunk(self, i: int, chunk: list[Sample]) -> RewardStats:
        workers = self.workers()
        worker = workers[i]
        try:
            rows, stats = await worker.score.remote(chunk)
        except Exception as e:  # the worker died or could not run the call
            if isinstance(e, ImportError):  # RayTaskError wrapping an ImportError: a setup error
                raise
            logger.error(
                "reward worker %d failed on samples %s: %r; reward := %s",
                i, [sample_ref(s) for s in chunk], e, self.cfg.fallback_reward,
            )  # fmt: skip
            dead = isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
            if dead and workers[i] is worker:  # not yet replaced by a concurrent call
                ray.kill(worker)
                workers[i] = self._new_worker()
                logger.warning("reward worker %d is gone; started a new one", i)
            for sample in chunk:
                sample.reward, sample.reward_info = self.cfg.fallback_reward, {}
            return RewardStats(samples=len(chunk), failures=len(chunk), failed=[sample_ref(s) for s in chunk])
        for sample, (reward, info) in zip(chunk, rows, strict=True):
            sample.reward, sample.reward_info = reward, info
        return stats
