"""Paths of the config are made absolute on the driver and checked before any role starts: on the driver
before Ray, and on every node of the cluster (here the session's one node) with a probe of the run
folder. The errors name the config key, the path and the node."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax.config import load_config
from relax.config.paths import resolve_paths
from relax.orchestration.preflight import PreflightError, check_local, check_nodes
from relax.utils.net import bind_address, resolve_bind


def cfg_for(model: str, data: str, out: str, *extra: str):
    return load_config(
        None, [f"model.path={model}", f"data.train_files=[{data}]", f"run.output_dir={out}", *extra]
    )


def test_relative_paths_become_absolute_against_the_driver_folder(tmp_path):
    (tmp_path / "models/m").mkdir(parents=True)  # `org/name` that is a folder under the base stays a folder
    cfg = cfg_for("models/m", "data/a.jsonl", "runs", "eval.sets=[{name: e, files: [data/e.jsonl]}]")
    resolve_paths(cfg, base=tmp_path)
    assert cfg.model.path == str(tmp_path / "models/m")
    assert cfg.data.train_files == [str(tmp_path / "data/a.jsonl")]
    assert cfg.eval.sets[0].files == [str(tmp_path / "data/e.jsonl")]
    assert cfg.run.run_dir == tmp_path / "runs" / "relax-run"
    again = resolve_paths(cfg, base=Path("/elsewhere"))  # absolute paths stay as they are
    assert again.model.path == str(tmp_path / "models/m")


def test_the_driver_check_names_each_unusable_path(tmp_path, tiny_model_dir, arith_file):
    check_local(cfg_for(str(tiny_model_dir), str(arith_file), str(tmp_path)))
    bare = tmp_path / "no_config"
    bare.mkdir()
    cfg = cfg_for(
        str(tmp_path / "missing_model"),
        str(tmp_path / "missing.jsonl"),
        str(tmp_path),
        f"model.reference_path={bare}",
    )
    with pytest.raises(PreflightError) as e:
        check_local(cfg)
    msg = str(e.value)
    assert "model.path = " in msg and "missing_model: no such folder" in msg
    assert "model.reference_path" in msg and "no config.json" in msg
    assert "data.train_files[0]" in msg and "missing.jsonl: no such file" in msg


def test_data_rows_are_checked_before_ray_naming_file_and_line(tmp_path, tiny_model_dir):
    """A row that selects code (`builtins:print`) or an unknown reward, and rows without the label their
    reward compares with, stop the run before Ray starts; the error names the file and the line."""
    import json

    data = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"prompt": "2+2=", "label": "4", "metadata": {"rm_type": "builtins:print"}},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PreflightError, match=r"line 2 of .*rows.jsonl: .*'builtins:print'.*neither built in"):
        check_local(cfg_for(str(tiny_model_dir), str(data), str(tmp_path)))

    data.write_text(
        json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n"
    )
    with pytest.raises(PreflightError, match=r"1 row\(s\) have no label.*line 2 of .*rows.jsonl"):
        check_local(cfg_for(str(tiny_model_dir), str(data), str(tmp_path), "reward.name=exact_match"))

    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + "{not json\n")
    with pytest.raises(PreflightError, match=r"rows.jsonl"):
        check_local(cfg_for(str(tiny_model_dir), str(data), str(tmp_path)))


def test_overlong_prompts_are_refused_or_dropped_before_ray(tmp_path, tiny_model_dir, caplog):
    """A 1 MB prompt on line 3: with data.overlong_prompts=error the run stops before Ray naming the key,
    file and line; with drop (the default) it is warned about once, naming them, and the check passes."""
    import json

    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}, {"prompt": "x" * 1_000_000}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PreflightError) as e:
        check_local(cfg_for(str(tiny_model_dir), str(data), str(tmp_path), "data.overlong_prompts=error"))
    msg = str(e.value)
    assert msg.startswith("data.train_files: 1 of 3 prompt(s) are longer than data.max_prompt_len=1024")
    assert f"line 3 of {data} (" in msg and "data.overlong_prompts=drop" in msg

    # the dropped row has no label: dropped rows are not checked for the reward they would need
    with caplog.at_level("WARNING", logger="relax.orchestration.preflight"):
        check_local(cfg_for(str(tiny_model_dir), str(data), str(tmp_path), "reward.name=exact_match"))
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warned) == 1 and "dropped 1 of 3 prompt(s)" in warned[0] and f"line 3 of {data}" in warned[0]
    assert "data/dropped_overlong" in warned[0]


def test_every_node_checks_the_paths_and_proves_the_run_folder_is_shared(
    ray_cluster, tmp_path, tiny_model_dir, arith_file
):
    check_nodes(cfg_for(str(tiny_model_dir), str(arith_file), str(tmp_path)))
    assert not list((tmp_path / "relax-run").glob(".relax-node-probe-*"))  # probes are cleaned up
    with pytest.raises(PreflightError, match=r"node 127\.0\.0\.1: data\.train_files\[0\] = .*gone\.jsonl"):
        check_nodes(cfg_for(str(tiny_model_dir), str(tmp_path / "gone.jsonl"), str(tmp_path)))


def test_servers_stay_on_loopback_on_a_one_node_cluster(ray_cluster):
    assert resolve_bind("auto") == "loopback" and bind_address("auto") == "127.0.0.1"
    assert resolve_bind("node") == "node" and bind_address("node") == "127.0.0.1"  # the node is loopback


def test_an_unknown_weight_transport_is_named_before_ray_starts(tmp_path, tiny_model_dir, arith_file):
    cfg = cfg_for(
        str(tiny_model_dir), str(arith_file), str(tmp_path), "trainer.weight_sync_backend=carrier-pigeon"
    )
    with pytest.raises(PreflightError, match=r"weight_sync_backend 'carrier-pigeon'.*auto, disk, gloo, nccl"):
        check_local(cfg)
