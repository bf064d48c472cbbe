"""Each algorithm, selected by one config key, trains the toy task through the real stack and the reward
goes up: the mean of the last window beats the first window by a margin chosen from measured runs."""

from __future__ import annotations

import json

import pytest

from relax.config import load_config
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

STEPS = 30
WINDOW = 6
MARGIN = 0.03  # measured: every algorithm below gains 0.08-0.25 over these 30 steps

ALGORITHMS = [
    "grpo",
    "ppo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "gspo",
    "sapo",
    "cispo",
    "m2po",
]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_learns(name, ray_cluster, tiny_model_dir, arith_file, tmp_path):
    cfg = load_config(
        "examples/quickstart.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"algorithm.name={name}",
            f"trainer.num_steps={STEPS}",
            "rollout.prompts_per_step=32",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "eval.sets=[]",
        ],
    )
    Controller(cfg).run()
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last > first + MARGIN, f"{name}: reward {first:.3f} -> {last:.3f} ({[round(r, 2) for r in rewards]})"
