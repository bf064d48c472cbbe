"""A run whose reward function raises on some rows finishes: those samples get the fallback reward,
and the failures are counted in metrics.jsonl. Rewards run in a pool of two Ray reward workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.config import load_config
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

PROMPTS, SAMPLES, STEPS = 4, 4, 2


@pytest.fixture(autouse=True)
def _repo_root_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))


def test_run_with_a_failing_reward_finishes_and_counts_failures(
    ray_cluster, tiny_model_dir, arith_file, tmp_path
):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=flaky",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            "rollout.max_new_tokens=4",
            f"trainer.num_steps={STEPS}",
            "ops.progress=false",
            "resources.num_cpus=8",
            "reward.name=tests.e2e.reward_fns:flaky_exact_match",
            "reward.num_workers=2",
            "reward.fallback_reward=0.0",
        ],
    )
    assert Controller(cfg).run() == STEPS
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["reward/failures"] == PROMPTS * SAMPLES / 2  # every odd sample_id raised
        assert row["reward/samples"] == PROMPTS * SAMPLES and row["reward/timeouts"] == 0
        assert "train/loss" in row
