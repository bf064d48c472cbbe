"""Evaluation on held-out sets with the current weights: its own prompts (never the training stream, so
training data position and staleness are untouched), its own reward and sampling settings. Metrics go to
`eval/<set>/...`; a sample of responses with their scores to `<run_dir>/eval/<set>/step_<k>.jsonl`.

While it runs, `<out_dir>/progress.json` says how far it is (`EvalProgress`): the evaluator runs inside
the Rollout role, and `relax eval` draws its progress bar from this file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from relax.config import EvalSetConfig, RelaxConfig
from relax.data.dataset import PromptRow
from relax.data.overlong import load_checked
from relax.rewards import build_scorer
from relax.rollout.eval_metrics import eval_metrics
from relax.rollout.loop import RolloutLoop

logger = logging.getLogger(__name__)


class EvalProgress:
    """Prompts done out of all prompts of every set, written to `path` when a set starts, when the last
    prompt is done, and in between at most every `interval_s` (to a temporary file that is renamed, so a
    reader never sees half a file)."""

    def __init__(self, path: Path, total: int, interval_s: float = 0.5) -> None:
        self.path, self.total, self.interval_s = path, total, interval_s
        self.done = 0
        self.current = ""
        self._written = 0.0

    def start_set(self, name: str) -> None:
        self.current = name
        self.write()

    def tick(self) -> None:
        self.done += 1
        if time.monotonic() - self._written >= self.interval_s or self.done == self.total:
            self.write()

    def write(self) -> None:
        self._written = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"done": self.done, "total": self.total, "set": self.current}))
        os.replace(tmp, self.path)


def read_progress(path: Path) -> dict | None:
    """What `EvalProgress` last wrote to `path`, or None (not started, or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Evaluator:
    def __init__(self, cfg: RelaxConfig, loop: RolloutLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self.sets: list[tuple[EvalSetConfig, list[PromptRow], object]] = []
        for es in cfg.eval.sets:
            rows, _ = load_checked(es.files, cfg.data, loop.tokenizer, f"eval.sets[{es.name}]")
            # Eval rows get their own index space so their prompt-token cache never meets training rows.
            offset = -1_000_000 * (len(self.sets) + 1)
            rows = [dataclasses.replace(r, index=offset - i) for i, r in enumerate(rows)]
            if es.max_prompts:
                rows = rows[: es.max_prompts]
            self.sets.append((es, rows, build_scorer(es.reward or cfg.reward)))

    def sampling_params(self, es: EvalSetConfig) -> dict:
        params = self.loop.sampling_params()
        params.update(
            n=es.n_samples_per_prompt,
            temperature=es.temperature,
            top_p=es.top_p,
            top_k=-1,
            min_p=0.0,
            max_new_tokens=es.max_new_tokens or self.cfg.rollout.max_new_tokens,
        )
        return params

    async def evaluate(self, step: int, out_dir: Path | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        progress = None
        if out_dir is not None:
            progress = EvalProgress(out_dir / "progress.json", sum(len(rows) for _, rows, _ in self.sets))
        for es, rows, scorer in self.sets:
            if progress is not None:
                progress.start_set(es.name)
            samples, reward_metrics = await self.loop.generate(
                rows,
                0,
                self.sampling_params(es),
                scorer,
                on_group=None if progress is None else progress.tick,
            )
            stats = eval_metrics(samples, es.k_values, es.correct_threshold)
            stats["reward_failures"] = reward_metrics.get("reward/failures", 0.0)
            metrics.update({f"eval/{es.name}/{k}": v for k, v in stats.items()})
            if out_dir is not None and es.save_samples:
                self._save(out_dir / es.name / f"step_{step:06d}.jsonl", samples[: es.save_samples])
            logger.info("eval %s at step %d: reward %.3f", es.name, step, stats["reward_mean"])
        return metrics

    def _save(self, path: Path, samples) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as fh:
            for s in samples:
                row = {
                    "prompt": s.prompt,
                    "label": s.label,
                    "response": s.response_text,
                    "reward": s.reward,
                    "status": s.status.value,
                    "response_len": s.response_length,
                    "weight_version": s.weight_version,
                    "sample_id": s.sample_id,
                }
                fh.write(json.dumps(row, default=str) + "\n")
