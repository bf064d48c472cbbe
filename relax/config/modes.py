"""What each execution mode (`schedule.mode`) does, derived from the config in one place: which roles
stream, which stages run as their own services, how Rollout batches its writes, whether the Actor takes
the next step's rows ahead and overlaps the next update with the weight push. Roles, the Controller and
the data plane ask here instead of testing the mode themselves.

    colocate     rollout and training take turns; old/ref log-probs and advantages in process on the Actor
    hybrid       Rollout runs ahead in the background (staleness-gated); stages in process on the Actor
    fully_async  Rollout, ActorFwd, Reference and Advantages stream through the data plane as services
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax.config.relax_config import RelaxConfig

MODES = ("colocate", "hybrid", "fully_async")
# Modes whose roles other than the Actor stream in the background from `start(step)`.
STREAMING_MODES = frozenset({"hybrid", "fully_async"})


def is_streaming(cfg: RelaxConfig) -> bool:
    return cfg.schedule.mode in STREAMING_MODES


def stages_in_process(cfg: RelaxConfig) -> bool:
    """Whether the Actor computes old/ref log-probs and advantages itself (everything but fully_async)."""
    return cfg.schedule.mode != "fully_async"


def stage_roles(cfg: RelaxConfig) -> list[str]:
    """The fully_async services between Rollout and Actor: ActorFwd (unless pi_old is the engine's
    log-probs), Reference (when reference log-probs are needed) and Advantages; none in other modes."""
    if stages_in_process(cfg):
        return []
    roles = [] if cfg.algorithm.pi_old_from_rollout else ["actor_fwd"]
    if cfg.algorithm.needs_reference:
        roles.append("reference")
    return [*roles, "advantages"]


def sub_batch_groups(prompts_per_step: int) -> int:
    """Prompt groups in the sub-batches a streaming forward takes as they arrive (the in-process Actor's,
    ActorFwd's and Reference's): a quarter step."""
    return max(1, prompts_per_step // 4)


def overlaps_push(cfg: RelaxConfig) -> bool:
    """Whether step k+1's update starts while step k's weights are pushed (`schedule.overlap_push`):
    streaming modes only (colocate's next rollout needs the pushed weights first); by default with the
    in-process trainer, which publishes a copy of its weights kept when the update ended."""
    if not is_streaming(cfg):
        return False
    setting = cfg.schedule.overlap_push
    return not cfg.trainer.uses_group if setting is None else setting


def groups_per_put(cfg: RelaxConfig) -> int:
    """How many finished prompt groups one Rollout put carries at least (`RowWriter`): the fewest a
    reader of the step takes at once. fully_async without ActorFwd and Reference: Advantages and the
    Actor each take a whole step, so the step goes out in one put (each put costs TransferQueue three
    controller round trips and a storage one; docs/modes.md). With them, the sub-batch they forward. In
    colocate and hybrid (the in-process Actor forwards sub-batches as they arrive) whatever finished goes
    out once the put before it is done."""
    if cfg.schedule.mode != "fully_async":
        return 1
    if {"actor_fwd", "reference"} & set(stage_roles(cfg)):
        return sub_batch_groups(cfg.rollout.prompts_per_step)
    return cfg.rollout.prompts_per_step


def actor_fetches_ahead(cfg: RelaxConfig) -> bool:
    """Whether the streaming Actor takes step k+1's rows before step k+1 starts (`schedule.fetch_ahead`).
    The rollout ran ahead, so they are usually there, and taking them leaves the step's critical path.
    Only where taking them needs no forward pass on the current weights: pi_old from the engine or from
    ActorFwd, and no reference or critic in process."""
    if cfg.schedule.fetch_ahead is False or not is_streaming(cfg):
        return False
    algo = cfg.algorithm
    forward_in_process = algo.needs_reference or not algo.pi_old_from_rollout or algo.spec.needs_critic
    return not (stages_in_process(cfg) and forward_in_process)


def resolve_auto(cfg: RelaxConfig) -> RelaxConfig:
    """Replace the schedule's auto settings (None) by what this run does, so the run folder's
    config.yaml records what ran; what they resolve to is unchanged. Returns `cfg`."""
    s = cfg.schedule
    s.overlap_push = overlaps_push(cfg)
    s.fetch_ahead = actor_fetches_ahead(cfg)
    return cfg
