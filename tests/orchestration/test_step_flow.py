"""StepFlow (the driver's sequencing of role calls) against in-process stand-ins for Serve handles: a
failure of the running-ahead Rollout stops the next weight push before the Actor's weights go out, raised
by the Rollout's own `prepare_weight_update` (the post-train checks no longer ask `check` separately),
while the periodic `check` still asks the Rollout."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from relax.components.rollout import RolloutRole
from relax.orchestration.async_loop import StepFlow


class Response:
    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout_s: float | None = None):
        if self.error is not None:
            raise self.error
        return self.value


class Handle:
    """Records each call by name and runs it at once (coroutines to completion)."""

    def __init__(self, target) -> None:
        self.target, self.calls = target, []

    def __getattr__(self, name: str):
        handle = self

        class Method:
            def remote(self, *args):
                handle.calls.append(name)
                try:
                    value = getattr(handle.target, name)(*args)
                    if inspect.iscoroutine(value):
                        value = asyncio.run(value)
                    return Response(value)
                except Exception as e:  # noqa: BLE001 - handed to the caller, as Serve does
                    return Response(error=e)

        return Method()


class FakeRollout:
    """The Rollout's real `check` and `prepare_weight_update` over a stand-in state."""

    check = RolloutRole.check
    prepare_weight_update = RolloutRole.prepare_weight_update

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.began = 0

    def _failure(self) -> BaseException | None:
        return self.error

    async def begin_weight_update(self) -> None:
        self.began += 1

    async def elastic_plan(self) -> None:
        return None

    async def finish_weight_update(self, trained_step: int, admit: bool) -> list[str]:
        return []


class FakeActor:
    def __init__(self) -> None:
        self.version = 0

    async def train(self, step: int) -> dict[str, float]:
        return {"train/loss": 0.0}

    async def push_weights(self) -> int:
        self.version += 1
        return self.version


def flow() -> tuple[StepFlow, Handle, Handle]:
    rollout, actor = Handle(FakeRollout()), Handle(FakeActor())
    return StepFlow("fully_async", {"rollout": rollout, "actor": actor}), rollout, actor


def test_a_step_asks_the_rollout_only_to_prepare_and_finish():
    f, rollout, actor = flow()
    f.train(1)
    assert f.push_weights(1) == 1
    f.settle()
    assert rollout.calls == ["prepare_weight_update", "finish_weight_update"]
    assert actor.calls == ["train", "push_weights"]
    assert rollout.target.began == 1


def test_a_failed_rollout_stops_the_push_before_the_weights_go_out():
    f, rollout, actor = flow()
    rollout.target.error = RuntimeError("rollout step 3 failed: engine gone")
    f.train(1)
    with pytest.raises(RuntimeError, match="engine gone"):
        f.push_weights(1)
    assert "push_weights" not in actor.calls
    assert rollout.target.began == 0  # generation was not touched
    with pytest.raises(RuntimeError, match="engine gone"):
        f.check()  # the periodic check still asks the Rollout
    assert rollout.calls[-1] == "check"
