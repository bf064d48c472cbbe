"""Which roles a run deploys. To add a role, give it a `RoleSpec` in `ROLES` and say in `roles_for` when
a run needs it; which stages a mode runs as services is decided in `relax.config.modes`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from relax.config.modes import MODES, stage_roles

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


def _spec(name: str, cfg: RelaxConfig) -> RoleSpec:
    from relax.roles.actor import ActorRole
    from relax.roles.actor_fwd import ActorFwdRole
    from relax.roles.advantages import AdvantagesRole
    from relax.roles.genrm import GenRMRole
    from relax.roles.rollout import RolloutRole

    specs = {
        "rollout": lambda: RoleSpec("rollout", RolloutRole, 1.0, budget="rollout"),
        "actor": lambda: RoleSpec("actor", ActorRole, 1.0, budget="training"),
        "actor_fwd": lambda: RoleSpec("actor_fwd", ActorFwdRole, 1.0, budget="training"),
        "reference": lambda: RoleSpec("reference", ActorFwdRole, 1.0, {"reference": True}, budget="training"),
        "advantages": lambda: RoleSpec("advantages", AdvantagesRole, 0.5, budget="rollout"),
        "genrm": lambda: RoleSpec("genrm", GenRMRole, cfg.reward.genrm.num_cpus, budget="rollout"),
    }
    return specs[name]()


def roles_for(cfg: RelaxConfig) -> list[RoleSpec]:
    """The roles the run deploys: Rollout and Actor, the stage services of fully_async
    (`relax.config.modes.stage_roles`), and the GenRM judge service when `reward.genrm` is set."""
    mode = cfg.schedule.mode
    if mode not in MODES:
        raise ValueError(f"unknown schedule.mode {mode!r}; valid modes: {', '.join(MODES)}")
    names = ["rollout", "actor", *stage_roles(cfg)]
    if cfg.reward.genrm is not None:
        names.append("genrm")
    return [_spec(name, cfg) for name in names]


def run_roles(cfg: RelaxConfig, resume_step: int | None = None) -> list[RoleSpec]:
    """Every role the run deploys: the Metrics service (appending after `resume_step` when resuming)
    and `roles_for(cfg)`."""
    from relax.roles.metrics import MetricsRole

    return [RoleSpec("metrics", MetricsRole, 0.25, {"resume_step": resume_step}), *roles_for(cfg)]
