"""RewardScorer: custom functions of every kind, per-row routing, concurrency, timeouts and fallbacks."""

from __future__ import annotations

import asyncio
import logging
import pickle
from pathlib import Path

import pytest

from relax.data.sample import Sample
from relax.rewards import RewardConfig, RewardScorer, RewardStats

FNS = "rewards_custom_fns"


@pytest.fixture(autouse=True)
def _custom_fns_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def samples(responses: list[str], label: str = "7", group_size: int = 1, **metadata: str) -> list[Sample]:
    return [
        Sample(
            index=i,
            prompt="3+4=",
            label=label,
            response_text=r,
            group_id=i // group_size,
            metadata=dict(metadata),
        )
        for i, r in enumerate(responses)
    ]


def scorer(name: str, *row_rewards: str, **cfg: object) -> RewardScorer:
    """A scorer whose config names `row_rewards` too (rows may select only rewards the config names)."""
    type_kwargs = {**{r: {} for r in row_rewards}, **cfg.pop("type_kwargs", {})}  # type: ignore[dict-item]
    return RewardScorer(RewardConfig(name=name, type_kwargs=type_kwargs, **cfg))


def test_builtin_first_number_on_the_toy_task() -> None:
    batch = samples(["7", "8", " 7 ", "x"])
    stats = scorer("first_number").score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 0.0]
    assert all(s.reward_info == {} for s in batch)
    metrics = stats.as_metrics()
    assert metrics["reward/samples"] == 4 and metrics["reward/calls"] == 4
    assert metrics["reward/failures"] == 0 and metrics["reward/timeouts"] == 0
    assert metrics["reward/count/first_number"] == 4
    assert metrics["reward/latency_mean_s"] >= 0 and metrics["reward/latency_max_s"] >= 0


def test_math_and_dapo_run_in_worker_threads() -> None:
    # math-verify's own timeout uses signal.alarm, which fails off the main thread; the scorer's
    # worker threads must still verify.
    batch = samples(
        ["so \\boxed{0.5}", "\\boxed{\\dfrac{3}{4}}", "\\boxed{\\frac{1}{2}"], label="\\frac{1}{2}"
    )
    stats = scorer("math").score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 0.0, 0.0] and stats.failures == 0
    batch = samples(["\\boxed{7}", "\\boxed{6}"])
    batch[0].response_ids = [0] * 90
    scorer("dapo", kwargs={"max_response_length": 100, "overlong_buffer_len": 20}).score_sync(batch)
    assert [s.reward for s in batch] == [0.5, -1.0]  # 1 - (90 - 80) / 20 ; -1 - 0
    assert batch[0].reward_info == {"acc": 1.0, "overlong_penalty": -0.5}


def test_sync_sample_number_with_kwargs() -> None:
    batch = samples(["ab", "abcd"])
    scorer(f"{FNS}:length_reward", kwargs={"scale": 0.5}).score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 2.0]


def test_async_sample_dict_uses_reward_key_and_logs_the_rest() -> None:
    batch = samples(["7", "no"])
    scorer(f"{FNS}:async_dict_reward", reward_key="score").score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 0.0]
    assert batch[1].reward_info == {"chars": 2.0}


def test_dict_without_the_reward_key_falls_back() -> None:
    batch = samples(["7"])
    stats = scorer(f"{FNS}:async_dict_reward", fallback_reward=-1.0).score_sync(batch)  # key "reward"
    assert batch[0].reward == -1.0 and stats.failures == 1


def test_sync_group_reward_sees_whole_groups() -> None:
    batch = samples(["aaa", "a", "aa", "bb", "b", "bbb"], group_size=3)
    stats = scorer(f"{FNS}:group_rank").score_sync(batch)
    assert [s.reward for s in batch] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert stats.calls == 2 and stats.samples == 6


def test_async_group_dict_reward_in_group_order() -> None:
    batch = samples(["a", "b", "c", "d"], group_size=2)
    batch = [batch[0], batch[2], batch[1], batch[3]]  # groups interleaved in the batch
    scorer(f"{FNS}:async_group_dict").score_sync(batch)
    assert [(s.index, s.reward) for s in batch] == [(0, 0.0), (2, 0.0), (1, 1.0), (3, 1.0)]
    assert batch[0].reward_info == {"group_size": 2.0}


def test_group_reward_of_wrong_length_fails_the_group() -> None:
    batch = samples(["a", "b"], group_size=2)
    stats = scorer(f"{FNS}:wrong_length_group", fallback_reward=0.25).score_sync(batch)
    assert [s.reward for s in batch] == [0.25, 0.25] and stats.failures == 2


def test_per_row_routing_with_default_and_type_kwargs() -> None:
    batch = samples(["7", "7", "abc", "8"])
    batch[1].metadata["rm_type"] = "exact_match"
    batch[2].metadata["rm_type"] = f"{FNS}:length_reward"
    cfg = {"type_kwargs": {f"{FNS}:length_reward": {"scale": 2.0}}}
    stats = scorer("first_number", **cfg).score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 1.0, 6.0, 0.0]
    assert stats.counts == {"first_number": 2, "exact_match": 1, f"{FNS}:length_reward": 1}


def test_per_row_key_none_ignores_row_metadata() -> None:
    batch = samples(["7"], rm_type="exact_match", label="seven")
    scorer("first_number", per_row_key=None).score_sync(batch)
    assert batch[0].reward == 0.0  # first_number("7" vs "seven"), not exact_match


def test_unknown_row_reward_raises_listing_valid_names() -> None:
    batch = samples(["7"], rm_type="mathh")
    with pytest.raises(ValueError, match="reward 'mathh', which is neither built in .*first_number"):
        scorer("first_number").score_sync(batch)


def test_a_row_cannot_choose_code_the_config_does_not_name() -> None:
    """`metadata.rm_type: builtins:print` (or `sys:exit`) is refused, not imported and called."""
    for path in ("builtins:print", "sys:exit", f"{FNS}:length_reward"):
        with pytest.raises(ValueError, match="nor named in the config"):
            scorer("first_number").score_sync(samples(["7"], rm_type=path))


def test_exceptions_fall_back_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    batch = samples(["7", "8", "9"])
    batch[1].metadata["rm_type"] = f"{FNS}:raises"
    batch[2].metadata["rm_type"] = f"{FNS}:returns_nan"
    with caplog.at_level(logging.WARNING, logger="relax.rewards.scorer"):
        stats = scorer(
            "first_number", f"{FNS}:raises", f"{FNS}:returns_nan", fallback_reward=-0.5
        ).score_sync(batch)
    assert [s.reward for s in batch] == [1.0, -0.5, -0.5]
    assert stats.failures == 2 and stats.timeouts == 0
    assert stats.as_metrics()["reward/failures"] == 2.0
    failed = [r.getMessage() for r in caplog.records if "raises" in r.getMessage()]
    assert len(failed) == 1 and "index=[1]" in failed[0] and "boom on 1" in failed[0]


def test_missing_package_is_a_setup_error_not_a_fallback() -> None:
    with pytest.raises(ImportError, match="no_such_package_xyz"):
        scorer(f"{FNS}:needs_missing_package").score_sync(samples(["7"]))


def test_non_numeric_result_falls_back() -> None:
    batch = samples(["7"])
    stats = scorer(f"{FNS}:returns_text").score_sync(batch)
    assert batch[0].reward == 0.0 and stats.failures == 1


@pytest.mark.parametrize("fn", ["slow_sync", "slow_async"])
def test_timeouts_fall_back_and_are_counted(fn: str, caplog: pytest.LogCaptureFixture) -> None:
    import rewards_custom_fns as fns

    fns.reset_slow()
    batch = samples(["7", "7"])
    batch[0].metadata["rm_type"] = f"{FNS}:{fn}"
    s = scorer("first_number", f"{FNS}:{fn}", timeout_s=0.1, fallback_reward=-1.0)
    with caplog.at_level(logging.WARNING, logger="relax.rewards.scorer"):
        stats = s.score_sync(batch)
    finished_before_return = list(fns.FINISHED)
    fns.RELEASE.set()
    assert finished_before_return == []  # returned while the slow call still ran: it did not wait for it
    assert [x.reward for x in batch] == [-1.0, 1.0]
    assert stats.timeouts == 1 and stats.failures == 0
    assert any("timed out" in r.getMessage() and "index=[0]" in r.getMessage() for r in caplog.records)
    s.close()


@pytest.mark.parametrize("fn", ["tracked_async", "tracked_sync"])
def test_max_concurrency_bounds_calls_in_flight(fn: str) -> None:
    from rewards_custom_fns import InFlight

    InFlight.reset()
    batch = samples(["7"] * 8)
    stats = scorer(f"{FNS}:{fn}", max_concurrency=3).score_sync(batch)
    assert InFlight.peak == 3 and stats.calls == 8
    assert all(s.reward == 1.0 for s in batch)


def test_a_slow_sync_reward_stays_parallel_once_its_cost_is_known() -> None:
    from rewards_custom_fns import InFlight

    s = scorer(f"{FNS}:tracked_sync", max_concurrency=3)
    for _ in range(2):  # the second batch is scored knowing that each call takes ~50 ms
        InFlight.reset()
        assert s.score_sync(samples(["7"] * 6)).calls == 6 and InFlight.peak == 3
    s.close()


def test_a_cheap_sync_reward_scores_a_batch_in_one_thread() -> None:
    import rewards_custom_fns as fns

    s = scorer(f"{FNS}:cheap_rule")
    s.score_sync(samples(["7"]))  # learns that a call takes microseconds
    fns.THREADS.clear()
    batch = samples(["7", "6", "7", "x"] * 4)
    stats = s.score_sync(batch)
    assert [x.reward for x in batch] == [1.0, 0.0, 1.0, 0.0] * 4
    assert len(set(fns.THREADS)) == 1 and stats.calls == 16 and stats.failures == 0
    s.close()


def test_a_cheap_batch_holds_each_call_to_its_own_timeout(caplog: pytest.LogCaptureFixture) -> None:
    import rewards_custom_fns as fns

    fns.reset_slow()
    s = scorer(f"{FNS}:cheap_rule", timeout_s=0.2, fallback_reward=-1.0)
    s.score_sync(samples(["7"]))
    fns.THREADS.clear()
    batch = samples(["7", "hang", "boom", "7", "6"])
    with caplog.at_level(logging.WARNING, logger="relax.rewards.scorer"):
        stats = s.score_sync(batch)
    finished_before_return = list(fns.FINISHED)
    fns.RELEASE.set()
    assert finished_before_return == []  # returned while the hanging call still hung: it did not wait
    # the call after the hanging one ran in a new thread; every sample got its own outcome
    assert [x.reward for x in batch] == [1.0, -1.0, -1.0, 1.0, 0.0]
    assert stats.timeouts == 1 and stats.failures == 1 and stats.calls == 5
    assert stats.failed == ["1/0", "2/0"] and len(set(fns.THREADS)) == 2
    assert any("timed out" in r.getMessage() and "index=[1]" in r.getMessage() for r in caplog.records)
    s.close()


def test_a_missing_package_in_a_cheap_batch_is_still_a_setup_error() -> None:
    s = scorer(f"{FNS}:needs_missing_package")
    s._cost.add(f"{FNS}:needs_missing_package", 1e-6)  # as if its calls were known to be cheap
    with pytest.raises(ImportError):
        s.score_sync(samples(["7", "7"]))
    s.close()


def test_async_score_inside_a_running_loop_and_sync_refuses() -> None:
    s = scorer("first_number")
    batch = samples(["7"])

    async def main() -> RewardStats:
        with pytest.raises(RuntimeError, match="await"):
            s.score_sync(batch)
        return await s.score(batch)

    assert asyncio.run(main()).samples == 1 and batch[0].reward == 1.0
    s.score_sync(samples(["7"]))  # a second event loop: the semaphore is rebuilt for it


def test_scorer_pickles_as_its_config() -> None:
    s = scorer(f"{FNS}:length_reward", kwargs={"scale": 3.0}, max_concurrency=2)
    s.score_sync(samples(["ab"]))  # builds the thread pool, which cannot be pickled
    clone = pickle.loads(pickle.dumps(s))
    batch = samples(["abc"])
    clone.score_sync(batch)
    assert clone.cfg == s.cfg and batch[0].reward == 9.0
    s.close()
    clone.close()


def test_stats_merge() -> None:
    a = RewardStats(samples=2, failures=1, calls=2, latency_sum_s=1.0, latency_max_s=0.8, counts={"math": 2})
    b = RewardStats(
        samples=1, timeouts=1, calls=1, latency_sum_s=2.0, latency_max_s=2.0, counts={"math": 1, "f1": 0}
    )
    m = a.merge(b).as_metrics()
    assert m["reward/samples"] == 3 and m["reward/failures"] == 1 and m["reward/timeouts"] == 1
    assert m["reward/latency_mean_s"] == pytest.approx(1.0) and m["reward/latency_max_s"] == 2.0
    assert m["reward/count/math"] == 3 and m["reward/count/f1"] == 0
    assert RewardStats().as_metrics()["reward/latency_mean_s"] == 0.0


@pytest.mark.parametrize("fn", ["exits", "exits_async"])
def test_a_reward_that_calls_sys_exit_costs_its_sample_not_the_run(fn: str) -> None:
    batch = samples(["7", "7", "7"])
    batch[1].metadata["rm_type"] = f"{FNS}:{fn}"
    s = scorer("first_number", f"{FNS}:{fn}", fallback_reward=-1.0)
    for _ in range(2):  # the first calls are timed one by one, later ones batched as cheap calls
        stats = s.score_sync(batch)
        assert [x.reward for x in batch] == [1.0, -1.0, 1.0] and stats.failures == 1
    s.close()
