"""Each algorithm, selected by one config key, trains the toy task through the real stack.

GRPO, PPO (critic and GAE) and GSPO (sequence-level ratios) must learn: they do in
tests/e2e/test_modes_e2e.py, one per execution mode. The others run a few steps end to end here (their
losses and advantages are checked against closed forms in tests/algorithms): a learning run per
algorithm costs a minute of the suite, a smoke run a fraction of that. All of them gained 0.08-0.25
over 30 steps when last measured one by one.
"""

from __future__ import annotations

import json
import math

import pytest

from relax.config import load_config
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

# A run's start-up costs more than its steps, so CI runs end to end what no other run takes: the teacher
# (on_policy_distillation) and the on-policy-only path (rloo); grpo, ppo (the critic) and gspo learn in
# test_modes_e2e.py. The rest differ from those only in a policy loss, an advantage estimator or
# normalizer, or defaults, which tests/algorithms checks on tensors; they run end to end in the full tier
# (bash scripts/test.sh --full).
SMOKE = ["rloo", "on_policy_distillation"]
SMOKE_FULL = ["reinforce_plus_plus_baseline", "cispo", "reinforce_plus_plus", "sapo", "m2po", "dr_grpo"]
SMOKE_STEPS = 3


def _run(name: str, steps: int, tiny_model_dir, arith_file, tmp_path, engine) -> list[dict]:
    cfg = load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"algorithm.name={name}",
            f"trainer.num_steps={steps}",
            "rollout.prompts_per_step=32",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            "eval.sets=[]",
            *engine.overrides(),  # the session's engine server (tests/conftest.py)
            # the teacher: the tiny model's own folder (a smoke run; any model folder of the same vocabulary)
            *([f"model.reference_path={tiny_model_dir}"] if name == "on_policy_distillation" else []),
        ],
    )
    assert Controller(cfg).run() == steps
    return [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", [*SMOKE, *(pytest.param(n, marks=pytest.mark.full) for n in SMOKE_FULL)])
def test_algorithm_runs_end_to_end(name, ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path):
    rows = _run(name, SMOKE_STEPS, tiny_model_dir, arith_file, tmp_path, shared_engine)
    assert [r["step"] for r in rows] == list(range(1, SMOKE_STEPS + 1))
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        assert r["weight_version"] == r["step"]
        # the engine's own counters, scraped each step (relax/rollout/engine_stats.py): a roomy pool
        assert r["rollout/engine_preempted"] == 0 and 0 <= r["rollout/engine_cache_hit_rate"] <= 1, r
