"""Live progress for the terminal: a tqdm bar with the step's headline metrics, plus a periodic log line."""

from __future__ import annotations

import logging

from tqdm import tqdm

logger = logging.getLogger(__name__)

HEADLINE = {
    "rollout/reward_mean": "reward",
    "rollout/response_len_mean": "len",
    "train/loss": "loss",
    "perf/step_time_s": "s/step",
}


class Progress:
    def __init__(self, total: int, start: int, enabled: bool = True) -> None:
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled)

    def update(self, step: int, metrics: dict[str, float], log: bool = False) -> None:
        shown = {short: f"{metrics[k]:.3g}" for k, short in HEADLINE.items() if k in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(step - self.bar.n)
        if log:
            logger.info("step %d: %s", step, " ".join(f"{k}={v}" for k, v in shown.items()))

    def close(self) -> None:
        self.bar.close()
