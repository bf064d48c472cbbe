"""Command-line flags shared by the mode benchmarks (`modes.py`, `gpu_e2e.py`): how the streaming
modes batch and what they take as pi_old."""

from __future__ import annotations

import argparse


def add_async_flags(p: argparse.ArgumentParser, batch_order: str, max_aborts: int) -> None:
    p.add_argument(
        "--batch-order",
        choices=["step", "completion"],
        default=batch_order,
        help="hybrid/fully_async: `completion` trains each step on the first groups to finish, so a long "
        "response trains in a later step instead of holding its own back (needs partial rollout to pay "
        "off; colocate always uses `step`)",
    )
    p.add_argument(
        "--old-log-probs",
        choices=["recompute", "rollout"],
        default="recompute",
        help="pi_old: a forward pass per step (ActorFwd in fully_async) or the engine's log-probs (all modes)",
    )
    p.add_argument(
        "--max-aborts", type=int, default=max_aborts, help="times one sample may be aborted by a push"
    )
    p.add_argument(
        "--partial-mode",
        choices=["abort", "in_place"],
        default="abort",
        help="partial rollout: abort in-flight requests and resume them by a new request, or pause the "
        "engines in place and let the requests run on under the new weights (rollout.partial_rollout_mode)",
    )
