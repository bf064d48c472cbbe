"""The Metrics service: the one place every role reports to. Roles (and the HealthManager) `report`
metrics for a step at any time; the Controller `flush`es each step once it is done, which merges the
reports with the step's own metrics and writes them to every sink the config enables (JSONL always,
TensorBoard, W&B, ClearML; `relax.ops.metric_sinks`) and, with `ops.trace`, the step's phases to
`trace.json` (`relax.ops.trace`).

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import logging

from relax.config import RelaxConfig
from relax.ops.metric_sinks import build_sinks
from relax.ops.trace import Span, TraceWriter

logger = logging.getLogger(__name__)


class MetricsRole:
    def __init__(self, cfg: RelaxConfig, resume_step: int | None = None) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        cfg.run.run_dir.mkdir(parents=True, exist_ok=True)
        self.sinks = build_sinks(cfg, resume_step)
        self.trace = TraceWriter(cfg.run.run_dir / "trace.json") if cfg.ops.trace else None
        self.pending: dict[int, dict[str, float]] = {}  # step -> reported, not yet flushed
        self.last_flushed: int | None = None
        self.closed = False

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """Add metrics to step `step` (written with it when it is flushed)."""
        self.pending.setdefault(step, {}).update(metrics)

    def flush(self, step: int, metrics: dict[str, float], spans: list[Span] | None = None) -> None:
        """Write step `step`: `metrics` plus everything reported for it (or for earlier unflushed steps)."""
        row: dict[str, float] = {}
        for s in sorted(s for s in self.pending if s <= step):
            row.update(self.pending.pop(s))
        row.update(metrics)
        self.sinks.log(step, row)
        if self.trace is not None and spans:
            self.trace.write(step, spans)
        self.last_flushed = step

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sinks.close()
        if self.trace is not None:
            self.trace.close()
