"""What an installed Relax promises on its command line: one version everywhere, `python -m relax`, the
example configs reachable through `relax examples`, a licence, and `relax doctor` naming only extras
that pyproject.toml defines. (The same from a built wheel in a fresh venv: test_wheel_install.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import relax
from relax.config import load_config
from relax.entrypoints.cli import main
from relax.entrypoints.doctor import PACKAGES, run_doctor
from relax.entrypoints.examples_cmd import examples_dir, list_examples

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source(capsys):
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "relax.__version__"}
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"relax {relax.__version__}"


def test_python_dash_m_relax_is_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "relax", "--help"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    for command in ("train", "eval", "engine", "export", "status", "examples", "doctor"):
        assert command in out, command


def test_license_file_and_spdx_expression():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"  # an SPDX expression, not a table
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_examples_are_listed_shown_and_copied(tmp_path, capsys):
    found = list_examples()
    assert set(found) == {p.stem for p in (ROOT / "examples").glob("*.yaml")}
    assert examples_dir() == ROOT / "examples"  # a checkout reads the folder itself
    assert main(["examples", "list"]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^quickstart\s+GRPO on the arithmetic toy task", listing, re.M)

    assert main(["examples", "show", "quickstart"]) == 0
    assert capsys.readouterr().out == found["quickstart"].read_text()

    assert main(["examples", "copy", "quickstart", str(tmp_path)]) == 0
    copied = tmp_path / "quickstart.yaml"
    assert copied.read_text() == found["quickstart"].read_text()
    assert "relax train" in capsys.readouterr().out
    assert main(["examples", "copy", "quickstart", str(tmp_path)]) == 2  # no silent overwrite
    assert "--force" in capsys.readouterr().err
    assert main(["examples", "copy", "quickstart.yaml", str(tmp_path / "mine.yaml"), "--force"]) == 0

    assert main(["examples", "copy", "nonesuch", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nonesuch" in err and "quickstart" in err  # the error lists the real names


@pytest.mark.parametrize("name", sorted(list_examples()))
def test_every_example_is_a_valid_config(name):
    load_config(str(list_examples()[name]), [])


def test_doctor_names_only_real_extras(capsys):
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = [m for _, _, how in PACKAGES for m in re.findall(r"relax\[([^\]]+)\]", how)]
    assert named and all(x in extras for x in named), (named, extras)
    dependencies = " ".join(PYPROJECT["project"]["dependencies"])
    for dist, _, how in PACKAGES:
        if how == "required":  # "required" means a plain dependency
            assert re.search(rf"(^|\s|\"){re.escape(dist)}[<>=~!\[ ]", dependencies + " "), dist
    assert run_doctor(check_ray=False) == 0
    out = capsys.readouterr().out
    assert (
        f"relax       {relax.__version__}" in out and "relax[async]" not in out and "relax[math]" not in out
    )


@pytest.mark.parametrize("command", [["config", "--describe"], ["examples", "list"]])
def test_a_reader_that_closes_the_pipe_gets_no_traceback(command):
    # The reader is gone before the command writes a byte (as `| head -1` is once it has its line).
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
