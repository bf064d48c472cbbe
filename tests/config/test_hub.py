"""Models named by Hub id, resolved offline through a Hub cache the test builds in the layout
`huggingface_hub` writes (`models--org--name/{refs,snapshots}`), through the real resolution code."""

from __future__ import annotations

import shutil

import pytest

from relax.config import load_config
from relax.config.paths import resolve_paths
from relax.utils.hub import HubError, looks_like_hub_id, resolve_model, snapshot_of

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def build_hub_cache(cache, model_dir, repo_id="relax-test/tiny-qwen2", commits=(COMMIT,), main=COMMIT):
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    for commit in commits:
        shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)
    (repo / "refs" / "v1").write_text(commits[0])
    return repo


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, tiny_model_dir):
    """An offline Hub cache holding the tiny model at two commits, `main` at the second."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    build_hub_cache(cache, tiny_model_dir, commits=(COMMIT, OTHER), main=OTHER)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    for local in ("./Qwen/x", "/models/x", "~/x", "model", "a/b/c"):
        assert not looks_like_hub_id(local), local
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_hub_id("org/name")  # an existing folder stays a folder
    assert snapshot_of(f"/c/models--org--name/snapshots/{COMMIT}") == ("org/name", COMMIT)
    assert snapshot_of("/c/models--org--name/blobs/x") is None


def test_offline_resolution_pins_one_commit(offline_hub):
    folder, commit = resolve_model("relax-test/tiny-qwen2")
    assert commit == OTHER and folder.endswith(f"snapshots/{OTHER}")
    folder, commit = resolve_model("relax-test/tiny-qwen2", revision="v1")
    assert commit == COMMIT and folder.endswith(f"snapshots/{COMMIT}")


def test_config_names_the_snapshot_and_records_the_commit(offline_hub, arith_file, tmp_path):
    cfg = load_config(
        None,
        ["model.path=relax-test/tiny-qwen2", "model.revision=v1", f"data.train_files=[{arith_file}]"],
    )
    resolve_paths(cfg, tmp_path)
    assert cfg.model.path.endswith(f"snapshots/{COMMIT}") and cfg.model.revision == COMMIT
    resolve_paths(cfg, tmp_path)  # idempotent: the folder exists now
    assert cfg.model.revision == COMMIT


def test_a_missing_id_offline_names_the_id_and_the_variable(offline_hub, arith_file):
    cfg = load_config(None, ["model.path=relax-test/missing", f"data.train_files=[{arith_file}]"])
    with pytest.raises(HubError, match=r"model.path = relax-test/missing.*HF_HUB_OFFLINE=1"):
        resolve_paths(cfg)
    cfg = load_config(
        None, ["model.path=relax-test/tiny-qwen2", "model.revision=nope", f"data.train_files=[{arith_file}]"]
    )
    with pytest.raises(HubError, match="nope"):
        resolve_paths(cfg)
