"""Which roles an execution mode needs. To add a mode or a role, add it to `MODES` here; a role that only
some configurations need (GenRM) is added by `roles_for_mode` from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax.config import RelaxConfig


@dataclass(frozen=True)
class RoleSpec:
    name: str  # Serve application name and handle key
    cls: type  # plain Python class deployed as a Serve deployment
    num_cpus: float  # logical CPUs reserved for the replica


def _colocate() -> list[RoleSpec]:
    from relax.components.actor import ActorRole
    from relax.components.rollout import RolloutRole

    return [RoleSpec("rollout", RolloutRole, 1.0), RoleSpec("actor", ActorRole, 1.0)]


MODES = {"colocate": _colocate}


def roles_for_mode(mode: str, cfg: RelaxConfig | None = None) -> list[RoleSpec]:
    """The roles `mode` deploys, plus the GenRM judge service when `cfg.reward.genrm` is set."""
    if mode not in MODES:
        raise ValueError(f"unknown resources.mode {mode!r}; valid modes: {', '.join(sorted(MODES))}")
    roles = MODES[mode]()
    if cfg is not None and cfg.reward.genrm is not None:
        from relax.components.genrm import GenRMRole

        roles.append(RoleSpec("genrm", GenRMRole, cfg.reward.genrm.num_cpus))
    return roles
