"""`relax examples prepare NAME`: every shipped example is written with the model and data its opening
comment names, so that `relax train` finds everything it reads; an example whose optional package is
missing stops before Ray starts, naming the extra. No training here (tests/entrypoints/
test_wheel_install.py and scripts/wheel_examples.sh train from a wheel)."""

from __future__ import annotations

import importlib.util

import pytest

from relax.config import load_config
from relax.entrypoints.cli import main
from relax.entrypoints.examples_cmd import list_examples, prepare, recipe
from relax.orchestration import preflight, service
from relax.orchestration.preflight import PreflightError, check_local, missing_extras

CLUSTER_STORAGE = "/shared/relax"  # examples/cluster.yaml's shared folder, prepared under tmp here


@pytest.mark.parametrize("name", sorted(list_examples()))
def test_prepare_writes_everything_the_example_reads(name, tmp_path, monkeypatch):
    steps = recipe(list_examples()[name])
    assert steps, f"{name}.yaml's opening comment names no `relax tiny-model` / `relax data` line"
    assert any(s[0] == "tiny-model" for s in steps) and any(s[0] == "data" for s in steps), steps
    text = list_examples()[name].read_text()
    assert "scripts/quickstart.sh writes" not in text and f"relax examples prepare {name}" in text

    dest = tmp_path / name
    config = prepare(name, dest, say=lambda _: None)
    assert config.read_text() == text  # the example itself, unchanged
    if CLUSTER_STORAGE in text:  # the cluster's absolute paths are the prepared folder's
        config.write_text(text.replace(CLUSTER_STORAGE, str(dest)))
    monkeypatch.chdir(dest)  # relative config paths are resolved against the folder `relax train` runs in
    cfg = load_config(str(config), [])
    check_local(cfg)  # what `relax train` checks before Ray starts: paths, rows, prompts, extras
    index = cfg.rollout.agent.env_kwargs.get("index")
    assert index is None or (dest / index).is_file(), index


def test_prepare_keeps_what_exists_and_rejects_unknown_names(tmp_path, capsys):
    dest = tmp_path / "qs"
    prepare("quickstart", dest, say=lambda _: None)
    model = dest / ".relax/assets/quickstart-qwen2/model.safetensors"
    before = model.stat().st_mtime_ns
    said: list[str] = []
    prepare("quickstart", dest, say=said.append)
    assert model.stat().st_mtime_ns == before and any(s.startswith("kept ") for s in said), said

    assert main(["examples", "prepare", "nonesuch", "--dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "nonesuch" in err and "quickstart" in err
    assert not (tmp_path / "x").exists()


def _without(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )


@pytest.mark.parametrize(
    ("name", "module", "extra"), [("search_tool", "bm25s", "relax[agentic]"), ("lora", "peft", "relax[lora]")]
)
def test_a_missing_extra_stops_the_run_before_ray_starts(name, module, extra, tmp_path, monkeypatch, capsys):
    cfg = load_config(str(list_examples()[name]), [])
    assert missing_extras(cfg) == []  # the test environment has every extra
    _without(monkeypatch, module)
    (problem,) = missing_extras(cfg)
    assert repr(module) in problem and f"pip install '{extra}'" in problem
    with pytest.raises(PreflightError, match=r"needs packages that are not installed"):
        preflight.check_extras(cfg)

    def no_ray(*a, **k):
        raise AssertionError("Ray was started although a package the config needs is missing")

    monkeypatch.setattr(service, "start_ray", no_ray)
    monkeypatch.chdir(tmp_path)  # the check comes before the paths are looked at: nothing is prepared
    assert main(["train", str(list_examples()[name]), f"run.output_dir={tmp_path}/runs"]) == 1
    err = capsys.readouterr().err
    assert f"pip install '{extra}'" in err and "Traceback" not in err
