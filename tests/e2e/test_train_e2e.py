"""A short real run through Ray Serve: Controller -> Rollout (embedded engine over HTTP) -> Actor -> weight
sync, then resume from the checkpoint with the same step numbering. The same run names its model by Hub
id and its prompts by Hub data set (offline), and scores with a reward that raises on some rows in a pool
of two Ray reward workers: a run's start-up costs more than its steps, so one run checks all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.config import load_config
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

PROMPTS, SAMPLES = 4, 4
REQUIRED = [
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "train/grad_norm",
    "perf/step_time_s",
    "weight_version",
]


def small_config(tiny_model_dir, arith_file, out_dir, steps, extra=()):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files={arith_file}",  # one entry without the list: an hf://...?... entry needs no quotes
            f"run.output_dir={out_dir}",
            "run.name=e2e",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n_samples_per_prompt={SAMPLES}",
            "rollout.max_new_tokens=4",
            f"trainer.num_steps={steps}",
            "ops.checkpoint_interval=2",
            "ops.progress=false",
            "resources.num_cpus=8",
            *extra,
        ],
    )


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _repo_root_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))


# tests/e2e/reward_fns.py: raises on every odd sample_id; those samples get the fallback reward
FLAKY_REWARD = [
    "reward.name=tests.e2e.reward_fns:flaky_exact_match",
    "reward.num_workers=2",
    "reward.fallback_reward=0.0",
]


def check_reward_failures_counted(rows) -> None:
    """The run finished although its reward raised, and the failures were counted."""
    for row in rows:
        assert row["reward/failures"] == PROMPTS * SAMPLES / 2  # every odd sample_id raised
        assert row["reward/samples"] == PROMPTS * SAMPLES and row["reward/timeouts"] == 0
        assert "train/loss" in row


def test_train_then_resume(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """Besides training and resuming: `model.path: org/name` as verl and TRL configs write it and the
    prompts as a `datasets` name with config, split and column mapping (GSM8K's `question`/`answer`
    columns), from a Hub cache with the network off (local model folders and data files are what every
    other end-to-end test trains), and a reward that raises on some rows: the run finishes, those samples
    get the fallback reward, and the failures are counted in metrics.jsonl."""
    from huggingface_hub import constants

    from tests.config.test_hub import COMMIT, build_hub_cache
    from tests.data.test_hub_data import DCOMMIT, GSM, arith_gsm_files, build_dataset_cache

    build_hub_cache(tmp_path / "hub", tiny_model_dir)
    build_dataset_cache(tmp_path / "hub", arith_gsm_files())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_id = "relax-test/tiny-qwen2"

    cfg = small_config(hub_id, GSM, tmp_path, steps=3, extra=FLAKY_REWARD)
    assert Controller(cfg).run() == 3
    run_dir = cfg.run.run_dir
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in REQUIRED:
        assert key in rows[-1], key
    # Samples of step k come from weights v(k-1); after the update the engines report v(k).
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    assert rows[0]["train/rollout_logp_abs_diff_max"] < 1e-3  # engine and trainer agree (colocate, fp32)
    assert (run_dir / "config.yaml").exists()
    recorded = (run_dir / "config.yaml").read_text()
    assert f"revision: {COMMIT}" in recorded and f"snapshots/{COMMIT}" in recorded
    (data_file,) = cfg.data.train_files  # the split, written once into the run folder, names the commit
    assert Path(data_file).parent == run_dir / "data" and data_file in recorded
    assert json.loads(Path(data_file).with_suffix(".source.json").read_text())["commit"] == DCOMMIT
    assert list((run_dir / "tensorboard").iterdir())
    assert ckpt.latest_checkpoint(run_dir)[0] == 3
    check_reward_failures_counted(rows)

    with pytest.raises(FileExistsError, match="--resume"):
        Controller(cfg).run()

    cfg2 = small_config(hub_id, GSM, tmp_path, steps=5, extra=FLAKY_REWARD)
    assert Controller(cfg2, resume=True).run() == 5
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    check_reward_failures_counted(rows)
    assert rows[-1]["weight_version"] == 5
    assert ckpt.latest_checkpoint(run_dir)[0] == 5
    saved = json.loads((ckpt.step_dir(run_dir, 5) / "rollout.json").read_text())
    assert saved["source"]["position"] == 5 * PROMPTS  # five steps of four prompts consumed
