"""Scoring a batch of samples: route each to its reward, run the calls concurrently under limits, and
never let one bad sample (a raising or hanging reward) fail the batch.

``RewardScorer`` is a plain class built from a ``RewardConfig``; it pickles as its config alone, so the
Ray worker pool (``relax.rewards.pool``) hands each worker the config, builds the scorer inside it and
calls ``await scorer.score(samples)``; the workers' ``RewardStats`` add up with ``merge``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relax.data.sample import Sample
from relax.rewards.config import RewardConfig
from relax.rewards.registry import RewardSpec, allowed_rewards, check_row_reward, resolve_reward
from relax.rewards.sync_batch import CallCost, run_batch

logger = logging.getLogger(__name__)


def sample_ref(sample: Sample) -> str:
    """How logs and ``RewardStats.failed`` name a sample: ``<prompt index>/<sample id in group>``."""
    return f"{sample.index}/{sample.sample_id}"


def info_metric_name(key: str) -> str:
    """Metric name of a ``reward_info`` key: a namespaced key (``genrm/latency_s``) is kept as is, a plain
    one (``acc``) becomes ``reward/info/acc``."""
    return key if "/" in key else f"reward/info/{key}"


@dataclass
class RewardStats:
    """Counters of one or more ``score`` calls. ``as_metrics`` gives them as ``reward/...`` metrics."""

    samples: int = 0  # samples scored (including those given the fallback reward)
    failures: int = 0  # samples whose reward function raised (or returned an unusable result)
    timeouts: int = 0  # samples whose reward function ran past timeout_s
    calls: int = 0  # reward function calls (one per sample, or one per group for group rewards)
    latency_sum_s: float = 0.0  # summed wall time of the calls, seconds
    latency_max_s: float = 0.0  # slowest call, seconds
    counts: dict[str, int] = field(default_factory=dict)  # samples per reward type
    failed: list[str] = field(default_factory=list)  # sample_ref of each failed or timed-out sample
    info_sums: dict[str, float] = field(default_factory=dict)  # reward_info key -> sum over samples
    info_counts: dict[str, int] = field(default_factory=dict)  # reward_info key -> samples carrying it

    def add_info(self, info: dict[str, float]) -> None:
        """Count one sample's ``reward_info`` into the per-key means."""
        for key, value in info.items():
            self.info_sums[key] = self.info_sums.get(key, 0.0) + float(value)
            self.info_counts[key] = self.info_counts.get(key, 0) + 1

    def merge(self, other: RewardStats) -> RewardStats:
        """The sum of two stats (e.g. from several scoring workers)."""

        def added(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return RewardStats(
            samples=self.samples + other.samples,
            failures=self.failures + other.failures,
            timeouts=self.timeouts + other.timeouts,
            calls=self.calls + other.calls,
            latency_sum_s=self.latency_sum_s + other.latency_sum_s,
            latency_max_s=max(self.latency_max_s, other.latency_max_s),
            counts=added(self.counts, other.counts),
            failed=self.failed + other.failed,
            info_sums=added(self.info_sums, other.info_sums),
            info_counts=added(self.info_counts, other.info_counts),
        )

    def add_call(self, seconds: float) -> None:
        """Count one reward call that took ``seconds``."""
        self.calls += 1
        self.latency_sum_s += seconds
        self.latency_max_s = max(self.latency_max_s, seconds)

    def as_metrics(self) -> dict[str, float]:
        """``reward/samples``, ``reward/failures``, ``reward/timeouts``, ``reward/calls``,
        ``reward/latency_mean_s``, ``reward/latency_max_s``, ``reward/count/<type>`` per type, and the
        mean of each ``reward_info`` key over the samples carrying it (named by ``info_metric_name``)."""
        metrics = {
            "reward/samples": float(self.samples),
            "reward/failures": float(self.failures),
            "reward/timeouts": float(self.timeouts),
            "reward/calls": float(self.calls),
            "reward/latency_mean_s": self.latency_sum_s / self.calls if self.calls else 0.0,
            "reward/latency_max_s": self.latency_max_s,
        }
        metrics.update({f"reward/count/{t}": float(n) for t, n in sorted(self.counts.items())})
        for key in sorted(self.info_sums):
            metrics[info_metric_name(key)] = self.info_sums[key] / max(self.info_counts.get(key, 1), 1)
        return metrics


class RewardExited(RuntimeError):
    """A reward function called `sys.exit` (or raised SystemExit): that call failed, nothing else."""


def _timed(fn: Any, arg: Any, kwargs: dict[str, Any]) -> tuple[Any, float]:
    """``fn(arg, **kwargs)`` and how long it took (in the worker thread, so the hop is not counted). A
    SystemExit becomes `RewardExited` here: raised through asyncio, SystemExit would stop the rollout's
    event loop itself."""
    start = time.perf_counter()
    try:
        return fn(arg, **kwargs), time.perf_counter() - start
    except SystemExit as e:
        raise RewardExited(f"the reward function called sys.exit({e.code!r})") from None


async def _awaited(fn: Any, arg: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return await fn(arg, **kwargs)
    except SystemExit as e:  # see `_timed`
        raise RewardExited(f"the reward function called sys.exit({e.code!r})") from None


def _to_reward(result: Any, reward_key: str) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from a number or a dict result; raises on anything unusable or non-finite."""
    info: dict[str, float] = {}
    if isinstance(result, dict):
        if reward_key not in result:
            raise KeyError(f"reward result has no {reward_key!r} entry: {sorted(result)}")
        value = result[reward_key]
        for key, extra in result.items():
            if key != reward_key and isinstance(extra, (int, float)):
                info[str(key)] = float(extra)
    else:
        value = result
    if not isinstance(value, (int, float)):
        raise TypeError(f"reward must be a number, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"reward is not finite: {value!r}")
    return float(value), info


class RewardScorer:
    """Scores samples with the rewards a ``RewardConfig`` selects."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._specs: dict[str, RewardSpec] = {cfg.name: resolve_reward(cfg.name)}
        self._allowed = allowed_rewards(cfg.name, cfg.type_kwargs)
        self._pool: ThreadPoolExecutor | None = None  # runs sync reward functions; built on first use
        self._sem: asyncio.Semaphore | None = None  # bounds calls in flight; one per event loop
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._cost = CallCost()  # how long each reward's calls take: cheap sync ones are batched

    # -- pickling: only the config travels; pools and semaphores are rebuilt where it lands --
    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"])  # type: ignore[misc]

    def close(self) -> None:
        """Release the worker threads (without waiting for calls that timed out to finish)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def reward_type(self, sample: Sample) -> str:
        """The reward name or import path for ``sample``: its row's ``metadata[per_row_key]`` or the default."""
        key = self.cfg.per_row_key
        chosen = sample.metadata.get(key) if key else None
        return str(chosen) if chosen else self.cfg.name

    def spec(self, rm_type: str) -> RewardSpec:
        """The resolved reward for ``rm_type`` (cached). An unknown name raises: it is a data error; so is
        one the config does not allow (`allowed_rewards`)."""
        if rm_type not in self._specs:
            check_row_reward(rm_type, self._allowed, "a row")
            self._specs[rm_type] = resolve_reward(rm_type)
        return self._specs[rm_type]

    async def score(self, samples: list[Sample]) -> RewardStats:
        """Fill ``reward`` and ``reward_info`` of every sample; return what happened as ``RewardStats``."""
        stats = RewardStats(samples=len(samples))
        jobs: list[tuple[str, list[Sample]]] = []  # (reward type, samples of one call)
        groups: dict[tuple[str, int], list[Sample]] = {}
        cheap: dict[str, list[Sample]] = {}  # cheap sync per-sample rewards: one batch per thread
        for sample in samples:
            rm_type = self.reward_type(sample)
            stats.counts[rm_type] = stats.counts.get(rm_type, 0) + 1
            spec = self.spec(rm_type)
            if spec.kind == "group":
                if (rm_type, sample.group_id) not in groups:
                    groups[(rm_type, sample.group_id)] = []
                    jobs.append((rm_type, groups[(rm_type, sample.group_id)]))
                groups[(rm_type, sample.group_id)].append(sample)
            elif not spec.is_async and self._cost.cheap(rm_type):
                cheap.setdefault(rm_type, []).append(sample)
            else:
                jobs.append((rm_type, [sample]))
        await asyncio.gather(
            *(self._run(rm_type, batch, stats) for rm_type, batch in jobs),
            *(self._run_cheap(rm_type, batch, stats) for rm_type, batch in cheap.items()),
        )
        return stats

    def score_sync(self, samples: list[Sample]) -> RewardStats:
        """``score`` for callers without an event loop (raises inside a running loop: await ``score``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.score(samples))
        raise RuntimeError("score_sync called inside a running event loop; use `await scorer.score(...)`")

    async def _run(self, rm_type: str, batch: list[Sample], stats: RewardStats) -> None:
        """One reward call for ``batch`` (one sample, or one group), with timeout and fallback."""
        spec = self.spec(rm_type)
        arg: Sample | list[Sample] = batch if spec.kind == "group" else batch[0]
        reward_key = spec.reward_key or self.cfg.reward_key
        refs = [sample_ref(s) for s in batch]
        async with self._semaphore():
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(
                    self._call(rm_type, spec, arg, self.cfg.kwargs_for(rm_type)), self.cfg.timeout_s
                )
                results = self._check_group(result, len(batch)) if spec.kind == "group" else [result]
                scored = [_to_reward(r, reward_key) for r in results]
            except ImportError:
                raise  # a missing package is a setup error, not a bad sample
            except asyncio.TimeoutError:
                scored = self._timed_out(rm_type, batch, refs, stats)
            except Exception as e:  # a reward calling sys.exit (RewardExited) costs its samples, not the run
                scored = self._failed(rm_type, batch, refs, e, stats)
            finally:
                stats.add_call(time.perf_counter() - start)
        self._assign(batch, scored, stats)

    async def _run_cheap(self, rm_type: str, batch: list[Sample], stats: RewardStats) -> None:
        """A cheap sync per-sample reward on ``batch``: one worker thread scores them in turn, each call
        held to its own timeout (``relax.rewards.sync_batch``)."""
        spec = self.spec(rm_type)
        reward_key = spec.reward_key or self.cfg.reward_key
        async with self._semaphore():
            outcomes = await run_batch(
                self._executor(), spec.fn, batch, self.cfg.kwargs_for(rm_type), self.cfg.timeout_s
            )
        scored: list[tuple[float, dict[str, float]]] = []
        for sample, outcome in zip(batch, outcomes, strict=True):
            refs = [sample_ref(sample)]
            if outcome is None:
                stats.add_call(self.cfg.timeout_s)
                scored += self._timed_out(rm_type, [sample], refs, stats)
                continue
            ok, value, seconds = outcome
            self._cost.add(rm_type, seconds)
            stats.add_call(seconds)
            if isinstance(value, ImportError):
                raise value  # a missing package is a setup error, not a bad sample
            try:
                if not ok:
                    raise value
                scored.append(_to_reward(value, reward_key))
            except (Exception, SystemExit) as e:  # SystemExit: held by the batch thread, raised here
                scored += self._failed(rm_type, [sample], refs, e, stats)
        self._assign(batch, scored, stats)

    def _timed_out(
        self, rm_type: str, batch: list[Sample], refs: list[str], stats: RewardStats
    ) -> list[tuple[float, dict[str, float]]]:
        stats.timeouts += len(batch)
        stats.failed += refs
        logger.warning(
            "reward %r timed out after %.3gs for sample index=%s (index/sample_id %s); reward := %s",
            rm_type, self.cfg.timeout_s, [s.index for s in batch], refs, self.cfg.fallback_reward,
        )  # fmt: skip
        return [(self.cfg.fallback_reward, {}) for _ in batch]

    def _failed(
        self, rm_type: str, batch: list[Sample], refs: list[str], e: BaseException, stats: RewardStats
    ) -> list[tuple[float, dict[str, float]]]:
        stats.failures += len(batch)
        stats.failed += refs
        logger.warning(
            "reward %r failed for sample index=%s (index/sample_id %s): %r; reward := %s",
            rm_type, [s.index for s in batch], refs, e, self.cfg.fallback_reward, exc_info=e,
        )  # fmt: skip
        return [(self.cfg.fallback_reward, {}) for _ in batch]

    @staticmethod
    def _assign(
        batch: list[Sample], scored: list[tuple[float, dict[str, float]]], stats: RewardStats
    ) -> None:
        for sample, (reward, info) in zip(batch, scored, strict=True):
            sample.reward = reward
            sample.reward_info = info
            stats.add_info(info)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.max_concurrency, thread_name_prefix="relax-reward")
        return self._pool

    async def _call(
        self, rm_type: str, spec: RewardSpec, arg: Sample | list[Sample], kwargs: dict[str, Any]
    ) -> Any:
        if spec.is_async:
            return await _awaited(spec.fn, arg, kwargs)
        loop = asyncio.get_running_loop()
        result, seconds = await loop.run_in_executor(self._executor(), _timed, spec.fn, arg, kwargs)
        if spec.kind == "sample":
            self._cost.add(rm_type, seconds)  # cheap ones are batched from now on (`_run_cheap`)
        return await result if inspect.isawaitable(result) else result

    @staticmethod
    def _check_group(result: Any, n: int) -> list[Any]:
        if not isinstance(result, (list, tuple)) or len(result) != n:
            got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise ValueError(f"a group reward must return a list of {n} results, got {got}")
        return list(result)

    def _semaphore(self) -> asyncio.Semaphore:
        # asyncio primitives belong to one event loop; score_sync runs a fresh loop on each call.
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.cfg.max_concurrency), loop
        return self._sem
