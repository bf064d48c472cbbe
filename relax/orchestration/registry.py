"""Which roles an execution mode needs. To add a mode or a role, add it to `MODES` here; a role that only
some configurations need (GenRM) is added by `roles_for_mode` from the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax.config import RelaxConfig


@dataclass(frozen=True)
class RoleSpec:
    name: str  # Serve application name and handle key
    cls: type  # plain Python class deployed as a Serve deployment
    num_cpus: float  # logical CPUs reserved for the replica
    kwargs: dict = field(default_factory=dict)  # extra constructor arguments after the config
    # CPU budget the replica is pinned to: "rollout" or "training" (`resources.<budget>_cpus`), None = any
    budget: str | None = None


def _colocate() -> list[RoleSpec]:
    """Rollout and Actor take turns; old/ref log-probs and advantages in process on the Actor."""
    from relax.roles.actor import ActorRole
    from relax.roles.rollout import RolloutRole

    return [
        RoleSpec("rollout", RolloutRole, 1.0, budget="rollout"),
        RoleSpec("actor", ActorRole, 1.0, budget="training"),
    ]


def _fully_async() -> list[RoleSpec]:
    """Every stage its own service, streaming through the data plane (the Reference is added by
    `roles_for_mode` when the algorithm needs one)."""
    from relax.roles.actor_fwd import ActorFwdRole
    from relax.roles.advantages import AdvantagesRole

    return [
        *_colocate(),
        RoleSpec("actor_fwd", ActorFwdRole, 1.0, budget="training"),
        RoleSpec("advantages", AdvantagesRole, 0.5, budget="rollout"),
    ]


# hybrid deploys the colocate roles; the difference is that the Rollout runs ahead (streaming).
MODES = {"colocate": _colocate, "hybrid": _colocate, "fully_async": _fully_async}
# Roles that stream in the background from `start(step)` (everything but the Actor) in each mode.
STREAMING_MODES = {"hybrid", "fully_async"}


def overlaps_push(cfg: RelaxConfig) -> bool:
    """Whether step k+1's update starts while step k's weights are pushed (`resources.overlap_push`):
    streaming modes only (colocate's next rollout needs the pushed weights first); by default with the
    in-process trainer, which publishes a copy of its weights kept when the update ended."""
    if cfg.resources.mode not in STREAMING_MODES:
        return False
    setting = cfg.resources.overlap_push
    return not cfg.trainer.uses_group if setting is None else setting


def groups_per_put(cfg: RelaxConfig) -> int:
    """How many finished prompt groups one Rollout put carries at least (`RowWriter`): the fewest a
    reader of the step takes at once. In fully_async without ActorFwd and Reference, Advantages and the
    Actor each take a whole step, so the step goes out in one put: each put costs TransferQueue three
    controller round trips and a storage one, and one put a step instead of ~4 saved ~9 ms of CPU a step
    on 2 cores. With them, the sub-batch they forward. In colocate and hybrid (the in-process Actor
    forwards sub-batches as they arrive) whatever finished goes out once the put before it is done."""
    r = cfg.rollout
    if cfg.resources.mode != "fully_async":
        return 1
    if {"actor_fwd", "reference"} & {role.name for role in roles_for_mode("fully_async", cfg)}:
        from relax.dataplane.plane import sub_batch_groups

        return sub_batch_groups(r.prompts_per_step)
    return r.prompts_per_step


def roles_for_mode(mode: str, cfg: RelaxConfig | None = None) -> list[RoleSpec]:
    """The roles `mode` deploys, plus the GenRM judge service when `cfg.reward.genrm` is set."""
    if mode not in MODES:
        raise ValueError(f"unknown resources.mode {mode!r}; valid modes: {', '.join(sorted(MODES))}")
    roles = MODES[mode]()
    if mode == "fully_async" and cfg is not None:
        from relax.roles.actor_fwd import ActorFwdRole
        from relax.roles.advantages import needs_reference

        if cfg.algorithm.old_log_probs == "rollout":  # pi_old is the rollout column: nothing to compute
            roles = [r for r in roles if r.name != "actor_fwd"]
        if needs_reference(cfg):
            roles.append(RoleSpec("reference", ActorFwdRole, 1.0, {"reference": True}, budget="training"))
    if cfg is not None and cfg.reward.genrm is not None:
        from relax.roles.genrm import GenRMRole

        roles.append(RoleSpec("genrm", GenRMRole, cfg.reward.genrm.num_cpus, budget="rollout"))
    return roles
