"""`relax status` on run folders without a live API (the live case is in test_elastic_e2e.py)."""

from __future__ import annotations

import json

from relax.entrypoints.cli import main
from relax.utils.net import free_port


def test_status_of_a_stopped_run(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  num_steps: 50\n")
    rows = [
        {"step": 1, "rollout/reward_mean": 0.125, "weight_version": 1},
        {"step": 2, "rollout/reward_mean": 0.25, "weight_version": 2},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rollo')
    (run / "endpoints.json").write_text(json.dumps({"elastic_api": f"http://127.0.0.1:{free_port()}"}))
    assert main(["status", str(run), "--timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert "step      2 / 50" in out  # the torn last line of a killed run is skipped
    assert "reward    0.2500" in out and "weights   v2" in out
    assert "did not answer" in out and "the run has stopped at step 2 of 50" in out
    assert "finished" not in out

    assert main(["status", str(run), "--json", "--timeout", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 2 and data["reward"] == 0.25 and "api_error" in data


def test_status_of_a_finished_run_says_so_without_asking_its_api(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  num_steps: 2\n")
    rows = [{"step": 1, "rollout/reward_mean": 0.125}, {"step": 2, "rollout/reward_mean": 0.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "endpoints.json").write_text(json.dumps({"elastic_api": f"http://127.0.0.1:{free_port()}"}))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step      2 / 2" in out and "state     finished: all 2 steps done" in out
    assert "did not answer" not in out and "still going" not in out
    assert main(["status", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["finished"] is True and "api_error" not in data


def test_status_without_a_run_folder(tmp_path, capsys):
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "no run folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["status", str(empty)]) == 0
    out = capsys.readouterr().out
    assert "no step finished yet" in out and "endpoints.json" in out


def test_engine_key_for_an_external_engine(tmp_path, capsys, monkeypatch):
    """`--engine-key URL`: the key the run sends to that engine (never the run's token itself)."""
    from relax.utils.auth import engine_key
    from relax.utils.redact import write_secret_file

    monkeypatch.delenv("RELAX_RUN_TOKEN", raising=False)
    run = tmp_path / "r"
    assert main(["status", str(run), "--engine-key", "http://10.0.0.5:30000"]) == 2
    assert "no run token" in capsys.readouterr().err
    write_secret_file(run / "secrets" / "run_token", "tok-from-file")
    assert main(["status", str(run), "--engine-key", "http://10.0.0.5:30000"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == engine_key("tok-from-file", "http://10.0.0.5:30000") and "tok-from-file" not in out
    monkeypatch.setenv("RELAX_RUN_TOKEN", "tok-from-env")  # before the run exists
    assert main(["status", str(tmp_path / "later"), "--engine-key", "http://10.0.0.5:30000/"]) == 0
    assert capsys.readouterr().out.strip() == engine_key("tok-from-env", "http://10.0.0.5:30000")
