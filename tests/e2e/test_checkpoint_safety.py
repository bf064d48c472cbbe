"""Checkpoints a run resumes from are data, never code, and a broken one is a clear error: a truncated
weight shard or a tampered state file stops `--resume` naming the checkpoint and the earlier complete one
to use (and leaves the run's config.yaml as it was); a folder without its COMPLETE marker is skipped with
a warning; a pickled state file of an earlier release that carries code is refused. Two runs: the
training and the resume that meets the truncated shard (the Controller's error path, shared by every
load failure); the tampered state file goes straight to the loader the Actor calls, which is where it
is refused."""

from __future__ import annotations

import logging
import pickle

import pytest

from relax.backends.training.update import read_trainer_state
from relax.config import load_config
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow


class Boom:
    def __reduce__(self):  # what a tampered pickle carries: code run at load
        return (exec, ("raise SystemExit('tampered checkpoint ran code')",))


def cfg(tiny_model_dir, arith_file, tmp_path, engine, steps, *extra):
    return load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=ck",
            f"trainer.num_steps={steps}",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=2",
            "ops.checkpoint_interval=1",
            "ops.keep_checkpoints=3",
            "ops.progress=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *engine.overrides(),  # the session's engine server (tests/conftest.py)
            *extra,
        ],
    )


def test_broken_checkpoints_are_clear_errors(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path, caplog
):
    assert Controller(cfg(tiny_model_dir, arith_file, tmp_path, shared_engine, 2)).run() == 2
    run_dir = tmp_path / "ck"
    recorded = (run_dir / "config.yaml").read_text()
    step2 = ckpt.step_dir(run_dir, 2)
    shard = next((step2 / "actor" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated

    with pytest.raises(ckpt.CheckpointError, match=r"step_000002 cannot be loaded.*step_000001"):
        Controller(
            cfg(tiny_model_dir, arith_file, tmp_path, shared_engine, 3, "trainer.lr=0.5"), resume=True
        ).run()
    assert (run_dir / "config.yaml").read_text() == recorded  # a failed resume keeps the record

    (step2 / "COMPLETE").unlink()
    with caplog.at_level(logging.WARNING, logger="relax.orchestration.checkpoint"):
        found = ckpt.latest_checkpoint(run_dir, log=True)
    assert found is not None and found[0] == 1
    assert any("step_000002 is skipped" in r.getMessage() for r in caplog.records)

    step1 = ckpt.step_dir(run_dir, 1)
    state = step1 / "actor" / "trainer_state.json"
    state.unlink()
    state.with_suffix(".pt").write_bytes(pickle.dumps({"step": 1, "scheduler": Boom()}))
    # Boom's code would raise SystemExit, which pytest.raises(Exception) does not catch
    with pytest.raises(Exception) as refused:
        read_trainer_state(step1 / "actor", scheduler=None, state_file=state.name)
    assert "Weights only load failed" in str(refused.value)
    error = ckpt.load_failure(step1, refused.value, run_dir)  # what the Controller raises on it
    assert isinstance(error, ckpt.CheckpointError)
    assert "step_000001 cannot be loaded" in str(error) and "start the run again without --resume" in str(
        error
    )
