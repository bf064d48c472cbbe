"""Which roles an execution mode needs. To add a mode or a role, add it to `MODES` here."""

from __future__ import annotations

from dataclasses import dataclass


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


def roles_for_mode(mode: str) -> list[RoleSpec]:
    if mode not in MODES:
        raise ValueError(f"unknown resources.mode {mode!r}; valid modes: {', '.join(sorted(MODES))}")
    return MODES[mode]()
