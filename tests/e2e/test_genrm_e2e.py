"""A training run whose reward comes from GenRM: a tiny judge, fine-tuned in the test to answer with a
strict verdict (CORRECT when the reference is even, INCORRECT when odd), is served by the `genrm` role on
its own embedded engine; the Rollout's `genrm` reward asks it by Serve handle, and the scores reach
the trainer and metrics.jsonl."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from relax.config import load_config
from relax.data.dataset import PromptSource, load_prompts
from relax.orchestration.controller import Controller

sys.path.insert(0, str(Path(__file__).parent))
from genrm_judge import JUDGE_SYSTEM, JUDGE_TEMPLATE, expected_verdict, train_parity_judge  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS, SAMPLES, STEPS = 4, 4, 2
SCORES = {"CORRECT": 1.0, "INCORRECT": -1.0}  # a mapping no rule-based reward would produce


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("judge") / "tiny-judge"
    accuracy = train_parity_judge(out)
    assert accuracy == 1.0, f"the judge did not learn its verdicts (token accuracy {accuracy:.3f})"
    return out


def genrm_config(tiny_model_dir, arith_file, judge_dir, out_dir: Path, engine):
    section = {
        "reward": {
            "name": "genrm",
            "timeout_s": 120,
            "genrm": {
                "model_path": str(judge_dir),
                "prompt_template": JUDGE_TEMPLATE,
                "system_prompt": JUDGE_SYSTEM,
                "max_new_tokens": 16,
                "verdict_scores": SCORES,
                "unparsed_score": -5.0,
                "max_batch_size": 32,
                "batch_wait_s": 0.05,
            },
        }
    }
    path = out_dir / "genrm.yaml"
    path.write_text(yaml.safe_dump(section))
    return load_config(
        path,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={out_dir}",
            "run.name=genrm",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            "rollout.max_new_tokens=4",
            f"trainer.num_steps={STEPS}",
            "ops.progress=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *engine.overrides(),  # the session's engine server (tests/conftest.py)
            "resources.num_cpus=8",
        ],
    )


def test_training_reward_comes_from_the_genrm_judge(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, judge_dir, tmp_path
):
    cfg = genrm_config(tiny_model_dir, arith_file, judge_dir, tmp_path, shared_engine)
    assert Controller(cfg).run() == STEPS
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))

    # The prompts each step drew, as the Rollout's PromptSource draws them, and the judge's verdicts.
    source = PromptSource(load_prompts(arith_file), shuffle=cfg.data.shuffle, seed=cfg.run.seed)
    for row in rows:
        labels = [p.label for p in source.next_batch(PROMPTS)]
        correct = statistics.fmean(expected_verdict(label) == "CORRECT" for label in labels)
        assert row["reward/count/genrm"] == PROMPTS * SAMPLES  # every sample was judged
        assert row["reward/calls"] == PROMPTS  # one service request per prompt group
        assert row["reward/failures"] == 0 and row["reward/timeouts"] == 0
        assert row["genrm/unparsed"] == 0.0  # every answer was a well-formed verdict
        assert row["genrm/latency_s"] > 0
        assert row["genrm/correct"] == pytest.approx(correct)
        assert row["rollout/reward_mean"] == pytest.approx(correct * 1.0 + (1 - correct) * -1.0)
        assert "train/loss" in row
