"""The `schedule` section: how rollout and training take turns (relax/config/modes.py reads it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax.data.config import Section


class ScheduleConfig(Section):
    """How rollout and training take turns: the execution mode, how far rollout runs ahead, and the
    streaming knobs (relax/config/modes.py derives what each mode does from these)."""

    mode: Literal["colocate", "hybrid", "fully_async"] = Field(
        "colocate",
        description="Execution mode. colocate: rollout and training take turns (on-policy); hybrid: Rollout "
        "runs ahead while the Actor trains, old/ref log-probs and advantages in process on the Actor; "
        "fully_async: Rollout, Actor, ActorFwd, Reference and Advantages as separate streaming services.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="How many steps rollout may run ahead of training (relax/rollout/staleness.py); "
        "0 = on-policy. colocate generates each step on request, so it is on-policy whatever this says.",
    )
    data_plane: Literal["transferqueue", "ray"] = Field(
        "transferqueue",
        description="Where step data streams between roles: TransferQueue, or one Ray actor (lighter).",
    )
    balance_data: bool = Field(
        False, description="hybrid/colocate: order each step's rows into token-balanced rank shares."
    )
    fetch_ahead: bool | None = Field(
        None,
        description="hybrid/fully_async: the Actor takes step k+1's rows before step k+1 starts: during step "
        "k's update when it runs in rank processes (fsdp, GPUs), after it with the in-process trainer "
        "(overlapping the weight push; during the update the fetch would share its interpreter lock). "
        "None (auto) = on; false = off.",
    )
    overlap_push: bool | None = Field(
        None,
        description="hybrid/fully_async: the Actor starts step k+1's update while step k's weights are pushed, "
        "publishing a copy of them kept when step k's update ended (one more copy of the weights in "
        "memory). None (auto) = with the in-process trainer; the fsdp ranks publish their live shards.",
    )
    debug_train_delay_s: float = Field(
        0.0, ge=0, description="Testing: the Actor sleeps this long before each update (a slow trainer)."
    )
    debug_engine_step_sleep_s: float = Field(
        0.0,
        ge=0,
        description="Testing: each engine sleeps this long after every decode step (a slow rollout).",
    )
