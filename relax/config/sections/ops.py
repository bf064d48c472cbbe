"""The `ops` section: checkpoints, logging and metric sinks, health checks, restarts and notifications."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax.data.config import Section


class WandbConfig(Section):
    project: str = Field("relax", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user; None = the default).")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes `<run_dir>/wandb/offline-run-*` (sync later); online uploads."
    )


class ClearMLConfig(Section):
    project: str = Field("relax", description="ClearML project.")
    offline: bool = Field(True, description="Record the task locally (no server), uploadable later.")


class OpsConfig(Section):
    checkpoint_interval: int = Field(50, ge=0, description="Save every N steps (0 = only at the end).")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept on disk (oldest deleted).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run folder.")
    log_interval: int = Field(10, gt=0, description="Steps between one-line status logs.")
    progress: bool = Field(True, description="Show a live progress bar.")
    # -- health and recovery (relax/orchestration/health.py, relax/orchestration/recovery.py) --
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between a service's heartbeats.")
    heartbeat_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A service silent this many seconds is restarted (stateless) or fails the run.",
    )
    max_role_restarts: int = Field(
        3,
        ge=0,
        description="In-place restarts of one stateless role before a global restart is taken instead.",
    )
    step_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="A step (rollout, update, weight push, eval) running longer fails the run, naming the role "
        "and phase that stalled (relax/orchestration/watchdog.py); None = no limit.",
    )
    stop_grace_s: float = Field(
        60.0,
        gt=0,
        description="After SIGTERM/Ctrl-C the step in flight may finish (and be checkpointed) for this long; "
        "then the run stops without it. A second signal stops at once.",
    )
    max_global_restarts: int = Field(
        2, ge=0, description="Global restarts from the last checkpoint (Actor failure) before the run stops."
    )
    # -- metrics service and notifications (relax/roles/metrics.py, relax/ops/) --
    notify_urls: list[str] = Field(
        default_factory=list,
        description="Apprise URLs notified of run start, failures, restarts and the end (e.g. json://host/path).",
    )
    wandb: WandbConfig | None = Field(None, description="Log metrics to Weights & Biases (None = off).")
    clearml: ClearMLConfig | None = Field(None, description="Log metrics to ClearML (None = off).")
    trace: bool = Field(False, description="Write each step's phases as a Chrome trace (`trace.json`).")
