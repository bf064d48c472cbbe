"""StepFlow (the driver's sequencing of role calls) against in-process stand-ins for Serve handles: a
failure of the running-ahead Rollout stops the next weight push before the Actor's weights go out, raised
by the Rollout's own `prepare_weight_update` (the post-train checks no longer ask `check` separately),
while the periodic `check` still asks the Rollout. A push broken by a dead ActorFwd weight receiver (a real
closed port on loopback) restarts ActorFwd at once and retries with the new receiver in the group."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from relax.ops.notify import Notifier
from relax.orchestration.health import HealthManager
from relax.orchestration.step_flow import StepFlow
from relax.roles.rollout import RolloutRole


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

    async def metrics(self, step: int) -> dict[str, float]:
        return {"rollout/step": float(step)}

    async def finish_weight_update(
        self, trained_step: int, admit: bool, version: int | None = None
    ) -> list[str]:
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


def test_the_push_brings_the_trained_steps_rollout_metrics_without_a_call_of_its_own():
    f, rollout, _ = flow()
    f.train(3)
    f.begin_push(3, rollout_metrics=True)
    assert f.push_weights(3) == 1 and f.rollout_metrics == {"rollout/step": 3.0}
    f.settle()
    f.train(4)
    f.push_weights(4)  # begun here, as at the first push: no metrics asked
    assert f.rollout_metrics == {}
    assert rollout.calls == ["prepare_weight_update", "finish_weight_update"] * 2


class FakeStage:
    """A stage role (Advantages) whose background loop may have failed."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    async def metrics(self, step: int) -> dict[str, float]:
        if self.error is not None:
            raise self.error
        return {}


def test_a_step_calls_no_stage_role_and_the_periodic_check_raises_its_failure():
    """Advantages' metrics come with the Actor's, so a step makes no call to the stage roles; the loop's
    periodic check (and a long wait for the Actor) still asks them and raises a failed loop."""
    rollout, actor, stage = Handle(FakeRollout()), Handle(FakeActor()), Handle(FakeStage())
    f = StepFlow("fully_async", {"rollout": rollout, "actor": actor, "advantages": stage})
    for step in (1, 2):
        f.train(step)
        f.begin_push(step, rollout_metrics=True)
        f.push_weights(step)
        f.settle()
    assert stage.calls == []
    f.check(max_age_s=2.0)  # the stage roles were never checked: asked now
    assert stage.calls == ["metrics"]
    stage.target.error = RuntimeError("advantages: step 3 failed")
    f.check(max_age_s=60.0)  # checked a moment ago: not asked again
    assert stage.calls == ["metrics"]
    with pytest.raises(RuntimeError, match="step 3 failed"):
        f.check()


class VersionedActor(FakeActor):
    """Records which version each push asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int | None] = []

    async def push_weights(self, version: int | None = None) -> int:
        self.asked.append(version)
        return version if version is not None else await super().push_weights()


def test_overlap_push_sends_the_next_update_first_and_pushes_the_kept_copy():
    """overlap_push: step 2's update goes out before step 1's push, which asks for the copy of step 1's
    weights; `train(2)` then waits for the update already sent instead of sending another."""
    rollout, actor = Handle(FakeRollout()), Handle(VersionedActor())
    f = StepFlow("fully_async", {"rollout": rollout, "actor": actor}, overlap=True)
    f.train(1)
    f.train_ahead(2)
    assert f.training_ahead and f.training_step == 2
    assert f.push_weights(1) == 1
    f.train(2)
    assert not f.training_ahead
    assert actor.calls == ["train", "train", "push_weights"]
    assert actor.target.asked == [1]


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


# -- a weight receiver beside the engines (ActorFwd) dies before a push --------------------------------

ENGINE = "http://127.0.0.1:1"  # the engines' side of the group; the fakes never dial it


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def live_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def dead_url():
    with socket.socket() as s:  # a port that was free a moment ago and that nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class GroupActor(FakeActor):
    """Its push fails while the group holds a URL in `dead` (as the publisher's HTTP call to it does)."""

    def __init__(self, group: list[str], dead: set[str], fail_once: bool = False) -> None:
        super().__init__()
        self.group, self.dead, self.fail_once = group, dead, fail_once

    async def connect_engines(self, urls: list[str]) -> None:
        self.group = list(urls)

    async def push_weights(self) -> int:
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("a transient failure")
        gone = [u for u in self.group if u in self.dead]
        if gone:
            raise ConnectionError(f"inference engine at {gone[0]} is unreachable")
        return await super().push_weights()

    async def received_step(self) -> int:
        return 2


class ActorFwd:
    def __init__(self, url: str) -> None:
        self.url, self.started, self.trained = url, None, None

    async def weight_url(self) -> str:
        return self.url

    async def start(self, first_step: int) -> None:
        self.started = first_step

    async def mark_trained(self, step: int) -> None:
        self.trained = step

    async def metrics(self, step: int) -> dict[str, float]:
        return {}


class EngineRollout(FakeRollout):
    async def replace_dead_engines(self) -> dict:
        return {"urls": [ENGINE], "replaced": 0}


class Health(HealthManager):
    """The real restart and engine bookkeeping; the heartbeat board is left out (no Ray here)."""

    def __init__(self) -> None:
        self.ops = SimpleNamespace(max_role_restarts=3)
        self.notifier = Notifier([], "test")
        self.known, self.role_restarts, self.engine_restarts = {}, {}, 0

    def ask(self) -> None:
        return None

    def _snapshot(self, asked=None) -> dict:
        return {}  # every role beats: the heartbeats have not noticed the dead receiver yet

    def watch(self, names, timeout_s=0.0, *, replacing=None) -> None:
        pass


class Redeploy:
    """The run's `Deployment` as the step flow sees it: a restarted role's new handle."""

    def __init__(self, new: dict[str, Handle]) -> None:
        self.new, self.redeployed = new, []

    def redeploy(self, name: str) -> Handle:
        self.redeployed.append(name)
        return self.new[name]


def receiver_flow(receiver: str, dead: set[str], replacement: str, fail_once: bool = False):
    rollout = Handle(EngineRollout())
    actor = Handle(GroupActor([ENGINE, receiver], dead, fail_once))
    fwd = Handle(ActorFwd(receiver))
    new_fwd = Handle(ActorFwd(replacement))
    handles = {"rollout": rollout, "actor": actor, "actor_fwd": fwd}
    f = StepFlow("fully_async", handles, Health(), redeploy=Redeploy({"actor_fwd": new_fwd}))
    return f, actor, fwd, new_fwd


def test_a_push_broken_by_a_dead_actor_fwd_restarts_it_and_reaches_its_replacement(dead_url, live_url):
    f, actor, fwd, new_fwd = receiver_flow(dead_url, {dead_url}, live_url)
    f.train(2)
    assert f.push_weights(2) == 1
    f.settle()
    assert f.health.role_restarts == {"actor_fwd": 1}
    assert actor.target.group == [ENGINE, live_url]  # the retry's group holds the new receiver
    assert f.receivers == [live_url]
    assert new_fwd.target.started == 3  # after the step the Actor already holds
    assert new_fwd.target.trained == 2  # it received this push's weights
    assert fwd.target.trained is None


def test_a_push_that_fails_with_every_receiver_answering_restarts_nothing(live_url):
    f, actor, fwd, new_fwd = receiver_flow(live_url, set(), "http://127.0.0.1:2", fail_once=True)
    f.train(2)
    assert f.push_weights(2) == 1
    f.settle()
    assert f.health.role_restarts == {}
    assert actor.calls.count("push_weights") == 2
    assert "connect_engines" not in actor.calls  # nothing changed, so the group was not re-formed
    assert fwd.target.trained == 2 and new_fwd.target.started is None
