"""Registry resolution, the reward_fn decorator and RewardConfig validation errors."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from pydantic import ValidationError

from relax.data.sample import Sample
from relax.rewards import REWARDS, RewardConfig, RewardSpec, resolve_reward, reward_fn
from relax.rewards.registry import check_kwargs

FNS = "rewards_custom_fns"
BUILTINS = {
    "token_rate",
    "math",
    "multiple_choice",
    "exact_match",
    "first_number",
    "f1",
    "format_think_answer",
    "dapo",
    "remote",
}


@pytest.fixture(autouse=True)
def _custom_fns_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_builtins_are_registered_as_sample_rewards() -> None:
    assert set(REWARDS) == BUILTINS | {"genrm"}
    for name in BUILTINS:
        spec = resolve_reward(name)
        assert spec.name == name and spec.kind == "sample" and spec.reward_key == "reward"
    assert resolve_reward("remote").is_async and not resolve_reward("math").is_async
    genrm = resolve_reward("genrm")  # the LLM judge: one service request per group
    assert genrm.kind == "group" and genrm.is_async and genrm.reward_key == "reward"


def test_import_paths_resolve_with_their_declared_kind() -> None:
    assert resolve_reward(f"{FNS}:length_reward").kind == "sample"
    group = resolve_reward(f"{FNS}:group_rank")
    assert group.kind == "group" and not group.is_async and group.name == f"{FNS}:group_rank"
    agroup = resolve_reward(f"{FNS}:async_group_dict")
    assert agroup.kind == "group" and agroup.is_async
    assert resolve_reward(f"{FNS}:wrong_length_group").kind == "group"  # a RewardSpec object
    assert resolve_reward(f"{FNS}:InFlight.reset").fn is not None  # dotted attribute after the colon
    assert resolve_reward("relax.rewards.text:f1").fn is REWARDS["f1"].fn


def test_unknown_name_lists_the_builtins() -> None:
    with pytest.raises(ValueError, match="unknown reward 'exact_mach'") as info:
        resolve_reward("exact_mach")
    for name in BUILTINS:
        assert name in str(info.value)
    assert "package.module:function" in str(info.value)


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (f"{FNS}:no_such_fn", "has no attribute 'no_such_fn'"),
        (f"{FNS}:not_callable", "not callable"),
        (":fn", "must look like"),
        (f"{FNS}:", "must look like"),
    ],
)
def test_bad_import_paths(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_reward(path)


def test_reward_fn_decorator_and_spec_checks() -> None:
    @reward_fn
    def plain(sample: Sample) -> float:
        return 1.0

    @reward_fn(kind="group", reward_key="score")
    async def grouped(samples: list[Sample]) -> list[float]:
        return [1.0] * len(samples)

    class AsyncCallable:
        async def __call__(self, sample: Sample) -> float:
            return 1.0

    assert plain(Sample(index=0, prompt="")) == 1.0  # the function is returned unchanged
    assert RewardSpec(functools.partial(grouped)).is_async and RewardSpec(AsyncCallable()).is_async
    assert not RewardSpec(plain).is_async
    with pytest.raises(ValueError, match="kind"):
        reward_fn(kind="batch")
    with pytest.raises(ValueError, match="kind"):
        RewardSpec(plain, kind="batch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        RewardSpec(42)  # type: ignore[arg-type]


def test_check_kwargs() -> None:
    check_kwargs(resolve_reward("dapo"), {"max_response_length": 10})
    with pytest.raises(ValueError, match="max_response_length"):
        check_kwargs(resolve_reward("dapo"), {})
    with pytest.raises(ValueError, match="urll"):
        check_kwargs(resolve_reward("remote"), {"urll": "http://x"})


def test_config_defaults_and_kwargs_for() -> None:
    cfg = RewardConfig()
    assert (cfg.name, cfg.reward_key, cfg.per_row_key, cfg.fallback_reward) == (
        "math",
        "reward",
        "rm_type",
        0.0,
    )
    cfg = RewardConfig(
        name="dapo",
        kwargs={"max_response_length": 100},
        type_kwargs={"dapo": {"overlong_buffer_len": 10}, "remote": {"url": "http://127.0.0.1:1/"}},
    )
    assert cfg.kwargs_for("dapo") == {"max_response_length": 100, "overlong_buffer_len": 10}
    assert cfg.kwargs_for("remote") == {"url": "http://127.0.0.1:1/"}
    assert cfg.kwargs_for("f1") == {}  # default kwargs are not passed to other rewards
    assert all(field.description for field in RewardConfig.model_fields.values())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "exact_mach"}, "unknown reward 'exact_mach'.*exact_match"),
        ({"name": "no_such_module_xyz:fn"}, "cannot import module"),
        ({"name": f"{FNS}:missing"}, "has no attribute 'missing'"),
        ({"type_kwargs": {"f11": {}}}, "unknown reward 'f11'"),
        ({"name": "remote"}, "missing a required argument: 'url'"),
        ({"name": "first_number", "kwargs": {"scale": 2}}, "unexpected keyword argument 'scale'"),
        ({"type_kwargs": {f"{FNS}:length_reward": {"scal": 2}}}, "scal"),
        ({"timeout_s": 0}, "greater than 0"),
        ({"max_concurrency": 0}, "greater than or equal to 1"),
        ({"rewardkey": "x"}, "Extra inputs are not permitted"),
    ],
)
def test_config_errors(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RewardConfig(**fields)
