"""WeightGroup is the one owner of who receives the weights, and WeightPush re-forms the group only where
membership changed: at an elastic plan (with a fallback when the joining engines fail), after engines
were replaced, and after another receiver changed."""

from __future__ import annotations

from types import SimpleNamespace

from relax.ops.notify import Notifier
from relax.orchestration.health import HealthManager
from relax.orchestration.weight_push import WeightGroup, WeightPush
from tests.orchestration.test_step_flow import FakeActor, FakeRollout, Handle


class GroupActor(FakeActor):
    def __init__(self, refuse: set[str] = frozenset()) -> None:
        super().__init__()
        self.groups: list[list[str]] = []
        self.refuse = refuse

    async def connect_engines(self, urls: list[str]) -> None:
        if bad := [u for u in urls if u in self.refuse]:
            raise ConnectionError(f"{bad[0]} could not join")
        self.groups.append(list(urls))


class PlanRollout(FakeRollout):
    def __init__(self, plan=None, replaced=None) -> None:
        super().__init__()
        self.plan, self.replaced, self.formed, self.pushed_version = plan, replaced, None, None

    async def elastic_plan(self):
        return self.plan

    async def replace_dead_engines(self):
        return self.replaced

    async def elastic_join_failed(self, error: str) -> list[str]:
        return ["http://e1"]

    async def elastic_group_formed(self, urls: list[str]) -> None:
        self.formed = urls

    async def elastic_pushed(self, version: int) -> None:
        self.pushed_version = version

    async def engine_urls(self) -> list[str]:
        return ["http://e1"]


class Health(HealthManager):
    def __init__(self) -> None:
        self.ops = SimpleNamespace(max_role_restarts=3)
        self.notifier = Notifier([], "test")
        self.known, self.role_restarts, self.engine_restarts = {}, {}, 0


def make(rollout, actor, health=None):
    r, a = Handle(rollout), Handle(actor)
    group = WeightGroup(a)
    group.reform(["http://e1"])
    return WeightPush(r, a, group, health), group, a.target


def test_reform_forms_the_members_and_a_new_receiver_marks_the_group_stale():
    actor = GroupActor()
    group = WeightGroup(Handle(actor))
    assert group.reform(["http://e1", "http://e2"]) == ["http://e1", "http://e2"] and not group.stale
    group.set_receivers(["http://fwd"])
    assert group.stale and group.formed == ["http://e1", "http://e2"]
    group.reform()
    assert actor.groups[-1] == ["http://e1", "http://e2", "http://fwd"] and not group.stale


def test_an_unchanged_group_is_not_formed_again():
    push, _, actor = make(
        PlanRollout(replaced={"urls": ["http://e1"], "replaced": 0}), GroupActor(), Health()
    )
    assert push.push(1) == 1
    assert actor.groups == [["http://e1"]]


def test_replaced_engines_reform_the_group_and_are_counted():
    health = Health()
    rollout = PlanRollout(replaced={"urls": ["http://e1", "http://e9"], "replaced": 1})
    push, group, actor = make(rollout, GroupActor(), health)
    push.push(1)
    assert actor.groups[-1] == ["http://e1", "http://e9"] and group.engines == ["http://e1", "http://e9"]
    assert health.engine_restarts == 1


def test_an_elastic_plan_whose_engines_cannot_join_falls_back_to_the_old_members():
    rollout = PlanRollout(plan=["http://e1", "http://bad"])
    push, group, actor = make(rollout, GroupActor(refuse={"http://bad"}))
    assert push.push(1) == 1
    assert group.members == ["http://e1"] and actor.groups[-1] == ["http://e1"]
    assert rollout.formed == ["http://e1"] and rollout.pushed_version == 1


def test_a_failed_reform_leaves_the_group_stale():
    actor = GroupActor(refuse={"http://bad"})
    group = WeightGroup(Handle(actor))
    try:
        group.reform(["http://bad"])
    except ConnectionError:
        pass
    assert group.stale and group.formed is None


class RepairRollout(PlanRollout):
    """Engine 0 died mid-rollout; its replacement e2 is pending until a push gives it the weights."""

    def __init__(self) -> None:
        super().__init__(replaced={"urls": ["http://e2"], "replaced": 1, "pending": ["http://e2"]})
        self.admitted: list[str] = []

    async def admit_engines(self) -> list[str]:
        self.admitted, self.replaced = list(self.replaced["pending"]), {**self.replaced, "pending": []}
        return self.admitted


class VersionActor(GroupActor):
    async def push_weights(self, version: int | None = None) -> int:
        self.pushed = version
        return version


def test_a_repair_pushes_the_held_version_to_pending_replacements_once():
    rollout, actor = RepairRollout(), VersionActor()
    push, group, _ = make(rollout, actor, Health())
    push.version = 7  # what the other engines hold: the replacement gets the same, not a new step's
    push.repair()
    assert group.engines == ["http://e2"] and actor.pushed == 7 and rollout.admitted == ["http://e2"]
    assert push.health.engine_restarts == 1
    actor.pushed = None
    push.repair()  # nothing pending any more: no group, no push
    assert actor.pushed is None and actor.groups[-1] == ["http://e2"]
