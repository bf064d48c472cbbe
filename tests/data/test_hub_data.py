"""Prompt data named by a Hub data set (`hf://datasets/org/name?config=...&split=...`), resolved offline
through a Hub cache the test builds in the layout `huggingface_hub` writes (`datasets--org--name/{blobs,
refs, snapshots/<commit>}`, snapshot files linked to blobs), read by the real `datasets` library from the
README's `configs:` metadata and written as the run's JSONL prompt file by the real resolution code."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.config import load_config
from relax.config.paths import resolve_paths
from relax.data.dataset import DataError, load_prompt_files
from relax.data.hub_data import parse_hub_dataset
from relax.data.toy import arith_rows
from relax.orchestration.preflight import PreflightError, check_data
from relax.utils.hub import HubError, resolve_repo, snapshot_of

DCOMMIT = "1111111111111111111111111111111111111111"
DOLD = "2222222222222222222222222222222222222222"
REPO = "relax-test/arith-gsm"
GSM = f"hf://datasets/{REPO}?config=main&split=train&prompt=question&label=answer"

README = """---
license: mit
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
  default: true
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*.parquet
---
# arith-gsm

Arithmetic prompts in GSM8K's columns (`question`, `answer`).
"""


def _parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def gsm_rows(n: int, seed: int) -> list[dict]:
    """Arithmetic rows in GSM8K's columns (and an extra one, kept as it is)."""
    return [{"question": r["prompt"], "answer": r["label"], "level": 1} for r in arith_rows(n, seed=seed)]


def arith_gsm_files(n: int = 64) -> dict[str, bytes]:
    return {
        "README.md": README.encode(),
        "main/train-00000-of-00001.parquet": _parquet(gsm_rows(n, seed=1)),
        "main/test-00000-of-00001.parquet": _parquet(gsm_rows(8, seed=2)),
        "socratic/train-00000-of-00001.parquet": _parquet(gsm_rows(4, seed=3)),
    }


def build_dataset_cache(
    cache: Path, files: dict[str, bytes], repo_id: str = REPO, commit: str = DCOMMIT, refs: dict | None = None
) -> Path:
    """One commit of a data set repository in the Hub cache, as `huggingface_hub` lays it out: files in
    `blobs/` by hash, the snapshot folder of links to them, `refs/<branch>` naming commits."""
    org, name = repo_id.split("/")
    repo = cache / f"datasets--{org}--{name}"
    for rel, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, target in (refs or {"main": commit}).items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(target)
    return repo


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    """An offline Hub cache: the data set at two commits, `main` at DCOMMIT and `v0` at DOLD (whose
    train split has 16 rows, not 64)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    build_dataset_cache(cache, arith_gsm_files(16), commit=DOLD, refs={"v0": DOLD})
    build_dataset_cache(cache, arith_gsm_files(64), commit=DCOMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def config_with(tmp_path, train: str, *more: str):
    cfg = load_config(
        None, ["model.path=unused", f"data.train_files={train}", f"run.output_dir={tmp_path}", *more]
    )
    return resolve_paths(cfg, tmp_path)


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_entries_parse_as_trl_and_hffs_write_them():
    ds = parse_hub_dataset("hf://datasets/openai/gsm8k?config=main&split=test&prompt=question", "train", "k")
    assert (ds.repo_id, ds.config, ds.split, ds.revision) == ("openai/gsm8k", "main", "test", None)
    assert ds.columns == {"prompt": "question"}
    ds = parse_hub_dataset("hf://openai/gsm8k@v1.0", "test", "k")  # the short form; split by context
    assert (ds.repo_id, ds.config, ds.split, ds.revision) == ("openai/gsm8k", None, "test", "v1.0")
    assert parse_hub_dataset("hf://a/b?revision=refs%2Fpr%2F1", "train", "k").revision == "refs/pr/1"
    for bad, why in [
        ("hf://openai/gsm8k/main/train.parquet", "<org>/<name>"),
        ("hf://openai/gsm8k?splits=train", "unknown parameter 'splits'"),
        ("hf://openai/gsm8k@v1?revision=v2", "given twice"),
        ("hf://openai/gsm8k?prompt=q&label=q", "two parts"),
        ("hf://openai/gs m8k", "not a Hub repository id"),
        ("hf://openai/gsm8k?config=", "'config' is empty"),
    ]:
        with pytest.raises(DataError, match=rf"data.train_files\[0\] = .*{why}"):
            parse_hub_dataset(bad, "train", "data.train_files[0]")


def test_a_split_becomes_the_runs_prompt_file_with_its_columns_mapped(offline_datasets, tmp_path):
    cfg = config_with(
        tmp_path,
        GSM,  # one entry, without the list: a plain YAML scalar on the command line
        f"eval.sets=[{{name: held, files: ['hf://{REPO}?config=main&prompt=question&label=answer']}}]",
    )
    (train,) = cfg.data.train_files
    assert Path(train).parent == cfg.run.run_dir / "data"
    assert Path(train).name.startswith("relax-test--arith-gsm--main--train--")
    rows = read_jsonl(train)
    expected = gsm_rows(64, seed=1)
    assert len(rows) == 64  # main's train split, not v0's 16 rows or socratic's 4
    assert rows[5] == {"prompt": expected[5]["question"], "label": expected[5]["answer"], "level": 1}
    source = json.loads(Path(train).with_suffix(".source.json").read_text())
    assert source["commit"] == DCOMMIT and source["dataset"] == REPO and source["rows"] == 64
    (held,) = cfg.eval.sets[0].files
    assert len(read_jsonl(held)) == 8  # an eval set's split defaults to test

    loaded = load_prompt_files(cfg.data.train_files, cfg.data)
    assert loaded[5].prompt == expected[5]["question"] and loaded[5].label == expected[5]["answer"]
    assert loaded[5].where == f"line 6 of {train}"  # line N is row N of the split

    # the same source again: the file is reused, not rewritten (its inode stays)
    inode = os.stat(train).st_ino
    assert config_with(tmp_path, GSM).data.train_files == [train] and os.stat(train).st_ino == inode


def test_a_revision_pins_other_rows_and_a_config_its_own(offline_datasets, tmp_path):
    cfg = config_with(tmp_path, f"hf://{REPO}@v0?config=main&prompt=question&label=answer")
    assert len(read_jsonl(cfg.data.train_files[0])) == 16
    assert json.loads(Path(cfg.data.train_files[0]).with_suffix(".source.json").read_text())["commit"] == DOLD
    # no mapping: the columns stay as they are and data.prompt_key / data.label_key name them
    cfg = config_with(
        tmp_path, f"hf://{REPO}?config=socratic", "data.prompt_key=question", "data.label_key=answer"
    )
    assert [r.prompt for r in load_prompt_files(cfg.data.train_files, cfg.data)] == [
        r["question"] for r in gsm_rows(4, seed=3)
    ]


def test_jsonl_files_without_readme_configs(tmp_path, monkeypatch):
    """A repository of JSONL files named by split, without `configs:` metadata: `datasets` finds them."""
    from huggingface_hub import constants

    lines = "".join(json.dumps({"problem": f"{i}+0=", "solution": str(i)}) + "\n" for i in range(5))
    build_dataset_cache(
        tmp_path / "hub", {"data/train.jsonl": lines.encode(), "README.md": b"# plain\n"}, "o/plain"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = config_with(tmp_path, "hf://o/plain?prompt=problem&label=solution")
    rows = load_prompt_files(cfg.data.train_files, cfg.data)
    assert [(r.prompt, r.label) for r in rows] == [(f"{i}+0=", str(i)) for i in range(5)]


def test_only_the_chosen_configs_files_are_fetched(tmp_path, monkeypatch):
    """The card's `configs:` say which files a config reads: only those (and the card) are asked of the
    Hub. Proven offline with the cache as a partial download leaves it: main's files only, beside the
    listing of every file of the commit that `huggingface_hub` keeps (without which it cannot tell a
    partial snapshot): main resolves, socratic is missing and named, where asking for every file of the
    repository would fail for main too."""
    from huggingface_hub import constants
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    from huggingface_hub.utils import filter_repo_objects

    from relax.data.hub_data import config_patterns

    readme = tmp_path / "README.md"
    readme.write_text(README)
    main = ["main/train-*.parquet", "main/test-*.parquet"]
    assert config_patterns(readme, "main") == main and config_patterns(readme, None) == main  # default: true
    assert config_patterns(readme, "socratic") == ["socratic/train-*.parquet"]
    assert config_patterns(readme, "nope") == []  # only the card: `datasets` names the configs it lists
    files = arith_gsm_files()
    assert sorted(filter_repo_objects(list(files), allow_patterns=main)) == [
        f for f in sorted(files) if f.startswith("main/")
    ]
    readme.write_text("---\nconfigs:\n- config_name: all\n  data_files: data/**/*.jsonl\n---\n")
    assert config_patterns(readme, None) == ["data/**/*.jsonl", "data/*.jsonl"]
    readme.write_text("# no card metadata\n")
    assert config_patterns(readme, None) is None  # the conventions: every file

    cache = tmp_path / "hub"
    repo = build_dataset_cache(cache, {k: v for k, v in files.items() if not k.startswith("socratic/")})
    listing = {k: TreeCacheEntry(size=len(v), blob_id=hashlib.sha1(v).hexdigest()) for k, v in files.items()}
    write_tree_cache(str(repo), DCOMMIT, listing)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert len(read_jsonl(config_with(tmp_path, f"hf://{REPO}?config=main").data.train_files[0])) == 64
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1 is set"):  # what fetching every file would meet
        resolve_repo(REPO, DCOMMIT, "k", "dataset")
    with pytest.raises(HubError, match=r"relax-test/arith-gsm.*HF_HUB_OFFLINE=1 is set"):
        config_with(tmp_path, f"hf://{REPO}?config=socratic")


def test_errors_name_the_data_set_and_the_row(offline_datasets, tmp_path):
    with pytest.raises(
        DataError, match=r"data.train_files\[0\] = hf://.*config 'nope'.*Available: \['main', 'socratic'\]"
    ):
        config_with(tmp_path, f"hf://{REPO}?config=nope")
    with pytest.raises(DataError, match=r"split 'validation'.*\['train', 'test'\]"):
        config_with(tmp_path, f"hf://{REPO}?config=main&split=validation")
    with pytest.raises(
        DataError, match=rf"row 1 of data.train_files\[0\] = .*\(commit {DCOMMIT}\): no column 'q'"
    ):
        config_with(tmp_path, f"hf://{REPO}?config=main&prompt=q")
    # a column that is not a prompt: the row checks name the run's file and the line (= the row)
    cfg = config_with(
        tmp_path, f"hf://{REPO}?config=main&prompt=level&label=answer", "data.overlong_prompts=error"
    )
    with pytest.raises(
        PreflightError, match=r"line 1 of .*relax-test--arith-gsm--main--train--.*'prompt' must be a string"
    ):
        check_data(cfg)
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written is left


def test_a_missing_id_offline_names_the_id_and_the_variable(offline_datasets, tmp_path):
    with pytest.raises(
        HubError, match=r"data.train_files\[0\] = relax-test/missing.*HF_HUB_OFFLINE=1.*HF_HOME"
    ):
        config_with(tmp_path, "hf://datasets/relax-test/missing?config=main")
    with pytest.raises(HubError, match="'nope'"):
        config_with(tmp_path, f"hf://{REPO}@nope?config=main")
    with pytest.raises(
        DataError, match=r"= openai/gsm8k: no such file; .* hf://datasets/openai/gsm8k\?config="
    ):
        config_with(tmp_path, "openai/gsm8k")  # TRL's dataset_name, without Relax's hf://
    assert snapshot_of(f"/c/datasets--o/n/snapshots/{DCOMMIT}", "dataset") is None
    assert snapshot_of(f"/c/datasets--o--n/snapshots/{DCOMMIT}", "dataset") == ("o/n", DCOMMIT)
    assert snapshot_of(f"/c/datasets--o--n/snapshots/{DCOMMIT}") is None  # not a model


def test_relax_train_refuses_a_missing_id_before_ray_starts(tmp_path):
    """The command line, offline on an empty cache: exit 1 and the id and the variable named, no traceback."""
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: unused}\n"
        "data: {train_files: ['hf://datasets/relax-test/missing?config=main&split=train']}\n"
        f"run: {{output_dir: {tmp_path / 'runs'}}}\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-m", "relax", "train", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "relax-test/missing" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "relax-run" / "secrets").exists()  # Ray was never started
